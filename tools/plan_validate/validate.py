"""The plan's predictions against CPU measurements (the table in ``benchmarks/``; docs/planning.md).

For each TinyGPT size and each layout that runs on 4 processes, the predicted per-rank peak
(:func:`scaleloop.plan.memory.estimate`, fp32, Adam stepping tensor by tensor as it does on the
CPU) against the measured one (:mod:`plan_validate.measure`, the largest over the ranks), and the
predicted step time's order against the measured order. The CPU "target" for the times: every
rank gets its share of the cores at the FLOP/s one process reached on the same model, and the
links are Gloo's latency and bandwidth fitted to all-reduces measured in the same run.

``python tools/plan_validate --out benchmarks`` (from the repository's root) writes ``<date>_cpu-<N>core_plan.md``.
"""
from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from scaleloop.bench.costmodel import Interconnect, fit_fabric
from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import Options, estimate
from scaleloop.plan.profile import ModelProfile, ModelSpec, profile_model
from scaleloop.plan.target import GPUS, Target

#: Three small TinyGPT sizes (4 blocks, so that 4 pipeline stages can be cut) and their global batch.
SIZES: tuple[tuple[ModelSpec, int], ...] = (
    (ModelSpec(seq_len=32, vocab_size=64, d_model=32, n_layers=4, n_heads=4), 16),
    (ModelSpec(seq_len=64, vocab_size=128, d_model=64, n_layers=4, n_heads=4), 16),
    (ModelSpec(seq_len=64, vocab_size=256, d_model=128, n_layers=4, n_heads=4), 32),
)


#: Rounds of the layouts in turns that the step times are the median of (plan_validate.turns). With
#: 10, two layouts as fast as each other came out 8 or more to 2 in 11% of cases (two-sided,
#: 56/512): such pairs passed for settled; with 20 rounds, 16 or more to 4 happens in 1.2%.
ROUNDS = 20
#: Of the rounds, the share that must order a pair of layouts alike for the pair's order to
#: count as measured (the rest the machine's noise decides).
SETTLED = 0.8


def layouts_on_4() -> list[Layout]:
    """Every layout the planner considers that runs on 4 CPU processes (offload aside: on the
    CPU it moves nothing)."""
    out = []
    for ac in (False, True):
        out += [Layout("dp", dp=4, checkpointing=ac), Layout("fsdp", fsdp=4, checkpointing=ac),
                Layout("hsdp", dp=2, fsdp=2, checkpointing=ac), Layout("fsdp x tp", fsdp=2, tp=2, checkpointing=ac),
                Layout("fsdp x tp", tp=4, checkpointing=ac)]
    return out + [Layout("pp x dp", pp=2, dp=2, microbatches=4), Layout("pp x dp", pp=4, microbatches=8)]


def cpu_options(batch_size: int) -> Options:
    """What the measured runs do: fp32, Adam, whose CPU step goes tensor by tensor."""
    return Options(batch_size, "fp32", "adam", foreach_optimizer=False)


def predicted_peak(profile: ModelProfile, layout: Layout, batch_size: int) -> float:
    """The plan's per-rank peak for the measured run."""
    return estimate(profile, layout, cpu_options(batch_size)).peak


def cpu_target(fabric: dict[str, float], flops_per_s: float, world: int, cores: int,
               busy_flops_per_s: Optional[float] = None) -> Target:
    """This machine as a plan's target: ``world`` ranks sharing ``cores`` cores, Gloo links, and
    the least a collective costs between bursts of compute (``measure._fabric``). The compute:
    ``busy_flops_per_s``, the FLOP/s one rank reached while all ranks stepped at once, where
    measured (the host's own work slowed alike); otherwise ``flops_per_s``, one process's alone,
    shared by the ranks on the cores. The groups of a 2-D mesh take the crossing pairs' floors
    where the run measured them (``busy_cross_*``)."""
    fitted = fit_fabric(fabric)
    link = Interconnect("gloo", "Gloo on this machine", fitted.bandwidth_Bps, fitted.latency_s, "fitted")

    def floors(*keys: tuple[int, str]) -> tuple[tuple[int, float], ...]:
        # A tensor's floor less its bytes' own time, which the bandwidth term adds again.
        return tuple((ranks, max(0.0, fabric[key] - 2 * (ranks - 1) / ranks * fabric["data_bytes"]
                                 / fitted.bandwidth_Bps)) for ranks, key in keys if key in fabric)

    data = floors((world, "busy_data_s"), (2, "busy_pairs_data_s"))
    shared = busy_flops_per_s or flops_per_s * min(1.0, cores / world)
    return replace(GPUS["h100"], key="cpu", name="CPU process", memory_bytes=float("inf"), peak_flops=flops_per_s,
                   fp32_flops=shared, inside=link, between=link, per_node=world,
                   overlaps=False, host_latency_s=fitted.latency_s, collective_s=fabric.get("busy_small_s", 0.0),
                   collective_s_by_ranks=((2, fabric["busy_pairs_s"]),) if "busy_pairs_s" in fabric else (),
                   data_collective_s_by_ranks=data, host_share=max(1.0, flops_per_s / shared),
                   crossed_s_by_ranks=((2, fabric["busy_cross_s"]),) if "busy_cross_s" in fabric else (),
                   crossed_data_s_by_ranks=floors((2, "busy_cross_data_s")), cores=cores)


def one_process_flops(spec: ModelSpec, profile: ModelProfile, micro_batch: int, steps: int = 5) -> float:
    """FLOP/s one process with one thread reaches on ``spec``'s training step (its loop included),
    alone on the machine (the median of ``steps``, after one, as the busy ranks' is taken)."""
    import torch

    from plan_validate.measure import plain_step_s

    torch.set_num_threads(1)
    return profile.flops_per_sample * micro_batch / plain_step_s(spec, micro_batch, steps)


def concordance(predicted: Sequence[float], measured: Sequence[float],
                pairs: Optional[Sequence[tuple[int, int]]] = None) -> float:
    """Share of pairs (``pairs``: those of indices given; None: all) that the predicted and the
    measured times put in the same order."""
    if pairs is None:
        pairs = [(i, j) for i in range(len(predicted)) for j in range(i + 1, len(predicted))]
    same = sum((predicted[i] - predicted[j]) * (measured[i] - measured[j]) > 0 for i, j in pairs)
    return same / len(pairs) if pairs else 1.0


def settled_pairs(rows: Sequence[dict[str, Any]], share: float = SETTLED) -> list[tuple[int, int]]:
    """The pairs of ``rows`` (indices) whose order at least ``share`` of the rounds agree on; all
    pairs where the rows keep no rounds (runs before the rounds existed)."""
    from plan_validate.turns import pair_agreement

    pairs = [(i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))]
    if not all("round_s" in r for r in rows):
        return pairs
    return [(i, j) for i, j in pairs if pair_agreement(rows[i]["round_s"], rows[j]["round_s"]) >= share]


def validate_size(spec: ModelSpec, batch_size: int, layouts: Sequence[Layout], cores: int,
                  log: Any = print, rounds: int = ROUNDS) -> list[dict[str, Any]]:
    """Measure every layout at one size and set the plan's predictions beside the measurements
    (the step times: ``rounds`` rounds of the layouts in turns)."""
    from scaleloop.plan.hostwork import measure_host_work, measured_by_fake_group
    from plan_validate.turns import median_s, time_in_turns
    from plan_validate.measure import measure

    profile = profile_model(spec)
    flops = one_process_flops(spec, profile, batch_size // 4)
    host = measure_host_work(spec, layouts)
    rows, fabric, busy_step = [], None, None
    for layout in layouts:
        try:
            result = measure(spec, layout, batch_size, steps=2, warmup=1, fabric=fabric is None, timeout_s=120)
        except Exception as exc:   # one failed launch (a busy machine's timeout) is reported, not fatal
            log(f"  {layout.label:28s} FAILED: {str(exc).splitlines()[0]}")
            continue
        if fabric is None and result["fabric"]:
            fabric, busy_step = result["fabric"], result.get("busy_step_s")
        floor = None
        if measured_by_fake_group(layout):    # the same rank with sums that end at once: the peak's floor
            floor = measure(spec, layout, batch_size, group="fake")["peaks"][0]
        measured = max(result["peaks"])
        predicted = predicted_peak(profile, layout, batch_size)
        rows.append({"size": spec.describe(), "layout": layout.label, "measured_peak": measured,
                     "predicted_peak": predicted, "error": predicted / measured - 1, "peaks": result["peaks"],
                     "launch_step_s": result["step_s"], "layout_obj": layout, "floor_peak": floor})
        log(f"  {layout.label:28s} peak measured {measured / 2**20:7.2f} MiB, predicted {predicted / 2**20:7.2f} MiB "
            f"({predicted / measured - 1:+.1%})")
    if fabric is None:
        return rows
    # The step times: every layout in turns on the same 4 processes (plan_validate.turns).
    try:
        turns = time_in_turns(spec, [row["layout_obj"] for row in rows], batch_size, rounds=rounds, timeout_s=120)
    except Exception as exc:   # reported; the rows keep their own launch's time
        log(f"  the layouts in turns FAILED: {str(exc).splitlines()[0]}; step times from one launch each")
        turns = [None] * len(rows)
    for row, times in zip(rows, turns):
        if times is None:
            row["measured_step_s"] = row["launch_step_s"]
            continue
        row["round_s"], row["measured_step_s"] = times, median_s(times)
        log(f"  {row['layout']:28s} step {row['measured_step_s'] * 1e3:.1f} ms (median of {len(times)} rounds)")
    # The compute as the 4 ranks get it stepping at once (measured with the fabric).
    busy = profile.flops_per_sample * (batch_size // 4) / busy_step if busy_step else None
    for row in rows:
        row["fabric"], row["one_process_flops"], row["cores"], row["busy_flops"] = fabric, flops, cores, busy
        row["host_extra_s"], row["host_plain_s"] = host.extra(row["layout_obj"]), host.plain_s
        row["host_plain_checkpointed_s"] = host.plain_checkpointed_s
        _predict_step(row, profile, row.pop("layout_obj"), batch_size)
    return rows


def _predict_step(row: dict[str, Any], profile: ModelProfile, layout: Layout, batch_size: int) -> None:
    """The row's predicted step time from the inputs it keeps (the link, the FLOP/s, the host's
    work), and the same without the host's work."""
    from scaleloop.plan.hostwork import HostWork, key
    from scaleloop.plan.timing import step_time

    target = cpu_target(row["fabric"], row["one_process_flops"], 4, row["cores"], row.get("busy_flops"))
    options = cpu_options(batch_size)
    row["predicted_step_no_host_s"] = step_time(profile, layout, options, target, 1.0).total_s
    blocks = profile.spec.n_layers
    host = HostWork({key(layout): row.get("host_extra_s", 0.0)}, row.get("host_plain_s", 0.0), blocks, blocks)
    row["predicted_step_s"] = step_time(profile, layout, options, target, 1.0, host).total_s


def _mib(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(rows: Sequence[dict[str, Any]], hardware: str, took_s: float, load: str = "") -> str:
    """The benchmark's report: one table per size, the worst memory error and the order's agreement."""
    lines = ["# scaleloop plan against measurement (CPU, 4 processes)", "",
             f"Hardware: {hardware}. Written by `python tools/plan_validate` in {took_s / 60:.0f} min."
             + (f" The {load}." if load else ""), "",
             "Peak: the largest rank's, in MiB; measured with torch's CPU allocator accounting under "
             "`torch.profiler(profile_memory=True)` (`tools/plan_validate/measure.py`), predicted by `scaleloop plan`'s "
             "memory model (fp32, Adam). Floor: rank 0's peak on a fake process group, whose collectives end as they "
             "are issued (the same every run; FSDP and tensor parallelism only): a real Gloo group's peak lies above "
             "it by the finished collectives whose buffers its threads have not yet let go. Step: milliseconds per "
             "optimizer step, measured (rank 0, between barriers, no profiler; every layout of a size built on the "
             "same 4 processes and stepped in turns, the median of the rounds, `tools/plan_validate/turns.py`; "
             "'rounds q1-q3': the middle half of the rounds) and predicted (compute at the FLOP/s the plain "
             "step reached while the 4 processes stepped at once; Gloo's fitted latency and bandwidth, each "
             "collective at least what an all-reduce over its group adds between bursts of compute, of one float for "
             "scaleloop's agreements and of 64 KiB for the collectives that carry tensors, over the crossing pairs "
             "of a 2-D mesh for its groups of two; a pipeline's bubble only where its busy stages leave a core idle; "
             "the host work each layout adds, measured at tiny widths, `scaleloop/plan/hostwork.py`, slowed as the "
             "compute is, and a pipeline stage's pieces counted from the plain step; 'no host': without "
             "it). Rank: the layout's place by step time, 1 the fastest.", ""]
    for size in dict.fromkeys(r["size"] for r in rows):
        group = [r for r in rows if r["size"] == size]
        by_measured = sorted(range(len(group)), key=lambda i: group[i]["measured_step_s"])
        by_predicted = sorted(range(len(group)), key=lambda i: group[i]["predicted_step_s"])
        lines += [f"## {size}", "", "| layout | peak measured | floor | peak predicted | error | step measured | "
                  "rounds q1-q3 | step predicted | no host | rank measured | rank predicted |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for i, r in enumerate(group):
            no_host = r.get("predicted_step_no_host_s")
            lines.append(f"| {r['layout']} | {_mib(r['measured_peak'])} | {_mib(r.get('floor_peak'))} | "
                         f"{_mib(r['predicted_peak'])} | {r['error']:+.1%} | {r['measured_step_s'] * 1e3:.1f} | "
                         f"{_quartiles(r.get('round_s'))} | "
                         f"{r['predicted_step_s'] * 1e3:.1f} | {'-' if no_host is None else f'{no_host * 1e3:.1f}'} | "
                         f"{by_measured.index(i) + 1} | {by_predicted.index(i) + 1} |")
        measured = [r["measured_step_s"] for r in group]
        agree = concordance([r["predicted_step_s"] for r in group], measured)
        settled = settled_pairs(group)
        total = len(group) * (len(group) - 1) // 2
        worst = max(abs(r["error"]) for r in group)
        lines += ["", f"Worst memory error {worst:.1%}; pairs of layouts ordered alike by predicted and measured "
                      f"step time: {agree:.0%} of all {total}"
                  + (f" (without the host's work: {concordance([r['predicted_step_no_host_s'] for r in group], measured):.0%})"
                     if all("predicted_step_no_host_s" in r for r in group) else "")
                  + (f"; of the {len(settled)} pairs that at least {SETTLED:.0%} of the rounds ordered alike: "
                     f"{concordance([r['predicted_step_s'] for r in group], measured, settled):.0%}"
                     if all("round_s" in r for r in group) else "") + ".", ""]
    return "\n".join(lines)


def _quartiles(times: Optional[Sequence[float]]) -> str:
    """The middle half of a layout's rounds, in ms ("-" without rounds)."""
    import statistics

    if not times or len(times) < 2:
        return "-"
    q1, _, q3 = statistics.quantiles(times, n=4)
    return f"{q1 * 1e3:.0f}-{q3 * 1e3:.0f}"


#: The configuration tune-batch and the plan are compared on (one GPU; make gpu-check).
TUNE_SPEC = ModelSpec(seq_len=1024, vocab_size=32000)


def against_tune_batch(spec: ModelSpec = TUNE_SPEC, precision: str = "bf16") -> tuple[int, int]:
    """(tune-batch's largest per-device batch on this GPU, the plan's for the memory free here):
    TinyGPT at train's sizes, one GPU, Adam. Needs CUDA."""
    import torch

    from scaleloop.config import TrainConfig
    from scaleloop.plan.tune import tune_batch
    from scaleloop.plan.planner import largest_batch

    free = torch.cuda.mem_get_info()[0]    # after the CUDA context: what tensors may take
    cfg = TrainConfig(model="tinygpt", data="tokens", seq_len=spec.seq_len, vocab_size=spec.vocab_size,
                      n_samples=1 << 16, device="cuda", precision=precision, optimizer="adam", test_fraction=0.0,
                      progress=False, tensorboard=False, checkpoints=False).validate()
    tuned = tune_batch(cfg).search.max_batch
    profile = profile_model(spec, low_precision=precision != "fp32")
    planned = largest_batch(profile, Layout("dp", dp=1), Options(1, precision, "adam", foreach_optimizer=True), free)
    return tuned, planned


def _tune_check() -> int:
    tuned, planned = against_tune_batch()
    agree = abs(planned / tuned - 1) <= 0.10 if tuned else False
    print(f"largest per-device batch that fits: tune-batch {tuned}, plan {planned} "
          f"({planned / tuned - 1:+.1%}): {'agree' if agree else 'DO NOT agree'} within 10%")
    return 0 if agree else 1


def result_json(rows: Sequence[dict[str, Any]], hw: dict[str, Any]) -> dict[str, Any]:
    """The result as ``benchmarks/``' index reads it (``what``, ``title``, ``headline``), with every row."""
    errors = [abs(r["error"]) for r in rows]
    within = sum(e <= 0.10 for e in errors)
    return {"what": "plan", "title": "Plan: predicted against measured per-rank peak memory and step order, "
                                      "TinyGPT x 12 layouts on 4 CPU processes",
            "date": datetime.date.today().isoformat(), "hardware_slug": f"cpu-{hw['cores']}core", "hardware": hw,
            "headline": f"peak memory within 10% in {within} of {len(errors)} cases (worst {max(errors, default=0):.1%}); "
                        f"step-time order: {', '.join(f'{a:.0%}' for a in _agreements(rows))} of the pairs of layouts"
                        + (f" ({', '.join(f'{a:.0%}' for a in _agreements(rows, settled=True))} of those the rounds "
                           "ordered alike)" if all("round_s" in r for r in rows) else ""),
            "has_png": False, "rows": list(rows)}


def _agreements(rows: Sequence[dict[str, Any]], settled: bool = False) -> list[float]:
    """Per size, the share of pairs of layouts the predicted and measured times order alike
    (``settled``: of the pairs at least :data:`SETTLED` of the rounds ordered alike)."""
    out = []
    for size in dict.fromkeys(r["size"] for r in rows):
        group = [r for r in rows if r["size"] == size and "predicted_step_s" in r]
        if group:
            out.append(concordance([r["predicted_step_s"] for r in group], [r["measured_step_s"] for r in group],
                                   settled_pairs(group) if settled else None))
    return out


def share_fabric(rows: Sequence[dict[str, Any]]) -> None:
    """Give every row the median over the sizes of each fabric figure (the row's own measurement
    kept as ``fabric_measured``). The collectives are the machine's, not the model's, and one
    measurement moves a lot: a 64 KiB all-reduce over the 4 busy ranks read 7.4, 12.6 and 8.1 ms
    at the three sizes of one run."""
    import statistics

    own = list({r["size"]: r.get("fabric_measured", r["fabric"]) for r in rows if "fabric" in r}.values())
    if len(own) < 2:
        return
    keys = set.intersection(*(set(f) for f in own))
    shared = {k: statistics.median(f[k] for f in own) for k in sorted(keys)}
    for row in rows:
        if "fabric" in row:
            row.setdefault("fabric_measured", row["fabric"])
            row["fabric"] = shared


def _repredict(rows: Sequence[dict[str, Any]]) -> None:
    """The predicted peak and step of every row with the model as it is now, on the shared fabric."""
    share_fabric(rows)
    profiles = {spec.describe(): (profile_model(spec), batch) for spec, batch in SIZES}
    for row in rows:
        profile, batch = profiles[row["size"]]
        layout = next(l for l in layouts_on_4() if l.label == row["layout"])
        row["predicted_peak"] = predicted_peak(profile, layout, batch)
        row["error"] = row["predicted_peak"] / row["measured_peak"] - 1
        if "fabric" in row:   # the time model's inputs were kept: its prediction as it is now, too
            _predict_step(row, profile, layout, batch)


def _rerender(path: Path) -> int:
    """Recompute the predicted peaks of ``path``'s rows and rewrite its report (times kept)."""
    import json

    from scaleloop.bench.hardware import describe_hardware

    data = json.loads(path.read_text(encoding="utf-8"))
    rows = data["rows"] if isinstance(data, dict) else data
    _repredict(rows)
    hw = data["hardware"] if isinstance(data, dict) else describe_hardware()
    result = result_json(rows, hw)
    result["date"] = data.get("date", result["date"]) if isinstance(data, dict) else path.name[:10]
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    report = path.with_suffix(".md")
    head, _, _ = report.read_text(encoding="utf-8").partition("\n## ")
    head = head.split("\n\nThe measurements are this run's")[0]   # a previous re-render's note
    note = ("\n\nThe measurements are this run's; the predictions (peaks, and step times where the run kept the "
            "time model's inputs) were recomputed afterwards (`--from-json`) with the model as it is now.")
    body = markdown(rows, "", 0).partition("\n## ")[2]
    report.write_text(head.rstrip() + note + "\n\n## " + body, encoding="utf-8")
    print(f"rewrote {report}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure, compare, and write the report under ``--out`` (``--against-tune-batch``: the GPU check)."""
    import json

    from scaleloop.bench.hardware import describe_hardware, hardware_line, usable_cores

    parser = argparse.ArgumentParser(prog="python tools/plan_validate")
    parser.add_argument("--out", default="benchmarks", help="the folder the report goes to (default: benchmarks)")
    parser.add_argument("--sizes", type=int, default=len(SIZES), help="how many of the sizes (smallest first)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help=f"rounds of the layouts in turns that each step time is the median of (default {ROUNDS})")
    parser.add_argument("--against-tune-batch", action="store_true",
                        help="on a GPU: tune-batch's largest batch against the plan's (agree within 10%%)")
    parser.add_argument("--from-json", metavar="FILE",
                        help="no measuring: the predictions of the model as it is now (peaks, and step times where "
                             "FILE kept their inputs), against the measurements in FILE (an earlier run's JSON); "
                             "the report says so")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.sizes < 1:
        parser.error("--rounds and --sizes must be positive integers")
    if args.against_tune_batch:
        return _tune_check()
    if args.from_json:
        if not Path(args.from_json).is_file():
            parser.error(f"--from-json {args.from_json}: no such file (give an earlier run's JSON from benchmarks/)")
        return _rerender(Path(args.from_json))
    from scaleloop.bench.hardware import load_line

    start, rows, hw = time.perf_counter(), [], describe_hardware()
    for spec, batch in SIZES[:args.sizes]:
        print(spec.describe(), flush=True)
        rows += validate_size(spec, batch, layouts_on_4(), usable_cores(), rounds=args.rounds)
    _repredict(rows)
    name = f"{datetime.date.today().isoformat()}_cpu-{hw['cores']}core_plan"
    out = Path(args.out)
    text = markdown(rows, hardware_line(hw), time.perf_counter() - start, load_line(hw) or "")
    (out / f"{name}.md").write_text(text, encoding="utf-8")
    (out / f"{name}.json").write_text(json.dumps(result_json(rows, hw), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out / name}.md")
    return 0
