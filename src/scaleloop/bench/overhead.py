"""``scaleloop bench overhead``: what scaleloop costs, against plain PyTorch.

Three modes (``--mode``), each measured side by side in one process run, repetitions
interleaved (A, B, B, A, ...) so that whatever else changes on the machine during the benchmark
(clock boost, another process) hits both sides alike; the headline is a ratio of medians, with
the median, middle half and range of the per-repetition (paired) ratios:

- ``loop`` (default): scaleloop's training loop (``scaleloop.loop.training.train``) against the
  tutorial's hand-written loop with the same data path (batches gathered from the in-memory
  tensors with ``index_select``, see ``rawloop``). Same model, data, seed, batch and order:
  both end with the same weights. 1.00 means the loop costs nothing over the plain loop.
- ``datapath``: the same scaleloop loop against the tutorial's loop exactly as written, with
  its ``DataLoader(dataset, batch_size=B, shuffle=True)`` (one ``__getitem__`` per sample, then
  collation); and, on their own, one epoch of batches from that DataLoader against scaleloop's
  in-memory fast path (and, on a GPU, with the data kept on the device).
- ``startup``: fresh interpreters: ``import torch`` against ``import torch, scaleloop``, the
  whole library (``scaleloop.train``), and ``scaleloop --help``; which optional heavy modules
  each loads.

What is timed in ``loop`` and ``datapath`` is training only, the same span for both: from the
first batch of an epoch to the end of its last optimizer step, summed over epochs. scaleloop's
end-to-end time also includes what the plain loop does not do (evaluation, run directory,
curves); it is reported separately.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from scaleloop.bench.hardware import describe_hardware, hardware_slug, threads_text
from scaleloop.bench.rawloop import raw_train
from scaleloop.bench.report import BenchReport, Column, Table, fmt_rate
from scaleloop.bench.stats import summarize
from scaleloop.bench.workload import Workload
from scaleloop.errors import UsageError

Say = Callable[[str], None]

MODES = ("loop", "datapath", "startup")


@dataclass(frozen=True)
class OverheadOptions:
    workload: Workload
    batch_size: int = 64
    epochs: int = 5
    repeats: int = 31  # fewer leave a 1-2% ratio inside the noise of a shared machine
    threads: Optional[int] = None     # CPU threads for both loops (None: torch's default)
    quick: bool = False
    command: str = "scaleloop bench overhead"
    mode: str = "loop"
    fused_optimizer: bool = False     # scaleloop's run (and the raw loop's in mode "loop") uses fused=True
    channels_last: bool = False       # both loops: channels-last weights and 4-d inputs (train --channels-last)
    compile: bool = False             # both loops: the model compiled in place (train --compile)


def run_overhead(opts: OverheadOptions, say: Say) -> BenchReport:
    if opts.mode not in MODES:
        raise UsageError(f"--mode {opts.mode!r} is not one of: {', '.join(MODES)}")
    if opts.mode == "startup":
        from scaleloop.bench.startup import run_startup

        return run_startup(opts, say)
    previous = torch.get_num_threads()
    if opts.threads and opts.workload.device == "cpu":
        torch.set_num_threads(opts.threads)
    try:
        return _run_loops(opts, say)
    finally:
        torch.set_num_threads(previous)


def _repetitions(opts: OverheadOptions, cfg: Any, raw_cfg: Any, data_path: str,
                 say: Say) -> tuple[list[dict[str, Any]], float, int]:
    """Interleaved repetitions of both loops; returns them, the final weights' largest
    difference, and the optimizer steps of one run."""
    from scaleloop.loop.training import train
    from scaleloop.runtime.dist import DistEnv

    device = torch.device(opts.workload.device)
    env = DistEnv(device=device)
    reps: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scaleloop-bench-overhead-") as tmp:
        def scaleloop_run(i: int):
            return train(cfg.replace(out=f"{tmp}/run{i}"), env, log=lambda _m: None)

        say(f"overhead ({opts.mode}): warm-up (one run of each loop, not counted)")
        raw, ours = raw_train(raw_cfg, device, data_path), scaleloop_run(-1)
        if not ours.in_memory_data:
            raise UsageError(f"--data {cfg.model_data.data}: the overhead bench compares in-memory datasets only")
        saved = torch.load(Path(ours.run_dir) / "model.pt", map_location="cpu", weights_only=True)
        weights_diff = max(float((saved[k].float() - raw.state[k].float()).abs().max()) for k in saved)
        for i in range(opts.repeats):
            # Alternate which loop goes first, so neither always runs on a warmer (or hotter) machine.
            order = ("raw", "scaleloop") if i % 2 == 0 else ("scaleloop", "raw")
            rep: dict[str, Any] = {"repetition": i + 1, "first": order[0]}
            for which in order:
                if which == "raw":
                    r = raw_train(raw_cfg, device, data_path)
                    rep.update(raw_s=r.train_s, raw_samples=r.samples)
                else:
                    s = scaleloop_run(i)
                    rep.update(scaleloop_s=s.train_s, scaleloop_wall_s=s.wall_s, scaleloop_samples=s.samples)
            rep["ratio"] = rep["scaleloop_s"] / rep["raw_s"]
            reps.append(rep)
            say(f"  repetition {i + 1}/{opts.repeats}: {'tutorial' if data_path == 'dataloader' else 'raw'} "
                f"{rep['raw_s']:.3f} s, scaleloop {rep['scaleloop_s']:.3f} s (x{rep['ratio']:.3f})")
    return reps, weights_diff, ours.steps


def _run_loops(opts: OverheadOptions, say: Say) -> BenchReport:
    hw = describe_hardware()   # first: its load average is the one the measurements met
    device = torch.device(opts.workload.device)
    cfg = opts.workload.to_config(strategy="single", batch_size=opts.batch_size, epochs=opts.epochs,
                                  test_fraction=0.2, fused_optimizer=opts.fused_optimizer,
                                  channels_last=opts.channels_last, compile=opts.compile)
    data_path = "dataloader" if opts.mode == "datapath" else "gather"
    # The tutorial's loop as written: PyTorch's default optimizer, whatever scaleloop's uses.
    raw_cfg = cfg.replace(fused_optimizer=False) if data_path == "dataloader" else cfg
    raw_name = "tutorial loop, DataLoader(shuffle=True)" if data_path == "dataloader" else "raw PyTorch (hand-written)"
    reps, weights_diff, steps_per_run = _repetitions(opts, cfg, raw_cfg, data_path, say)
    batches = _data_only(cfg, device, opts, say) if opts.mode == "datapath" else None
    cost = None
    if opts.mode == "loop":
        from scaleloop.bench.loopcost import measure_loop_cost

        say("overhead (loop): the loop's own cost per step, piece by piece")
        cost = measure_loop_cost(cfg, device, quick=opts.quick)

    raw_s = summarize([r["raw_s"] for r in reps])
    sl_s = summarize([r["scaleloop_s"] for r in reps])
    ratios = summarize([r["ratio"] for r in reps])
    wall = summarize([r["scaleloop_wall_s"] for r in reps])
    samples = reps[0]["raw_samples"]
    ratio = sl_s["median"] / raw_s["median"]
    rows = [
        {"loop": raw_name, "median_s": raw_s["median"], "min_s": raw_s["min"],
         "max_s": raw_s["max"], "spread": raw_s["spread"], "samples_per_s": samples / raw_s["median"],
         "ratio": 1.0},
        {"loop": "scaleloop (scaleloop.loop.training.train)", "median_s": sl_s["median"], "min_s": sl_s["min"],
         "max_s": sl_s["max"], "spread": sl_s["spread"], "samples_per_s": samples / sl_s["median"],
         "ratio": ratio},
    ]
    table = Table("Training time, interleaved repetitions", [
        Column("loop", "loop"), Column("median_s", "median s", _fmt_s), Column("min_s", "min s", _fmt_s),
        Column("max_s", "max s", _fmt_s), Column("spread", "spread (max-min)/median", _fmt_pct),
        Column("samples_per_s", "samples/s", fmt_rate), Column("ratio", "time / raw", lambda v: f"{v:.3f}")], rows,
        f"{opts.repeats} repetitions of {opts.epochs} epoch(s) each ({samples:,} samples), "
        f"{opts.workload.describe()}, batch {opts.batch_size}, {describe_threads(device)}.")
    tables = [table]
    if cost is not None:
        from scaleloop.bench.loopcost import loop_cost_table

        tables.append(loop_cost_table(cost, raw_s["median"] / max(steps_per_run, 1)))
    data: dict[str, Any] = {"ratio": ratio, "ratio_per_repetition": ratios, "raw_s": raw_s, "scaleloop_s": sl_s,
                            "scaleloop_wall_s": wall, "final_weights_max_abs_diff": weights_diff,
                            "data_path": data_path, "repetitions": reps, "loop_cost": cost}
    if opts.mode == "datapath":
        what, title = "datapath", f"Data path: scaleloop's in-memory fast path vs the tutorial's DataLoader, " \
                                  f"{opts.workload.describe()}"
        headline = (f"scaleloop's loop is {1 / ratio:.2f}x as fast as the tutorial's DataLoader loop "
                    f"(paired, per repetition: median {1 / ratios['median']:.2f}x, middle half "
                    f"{1 / ratios['q3']:.2f}x - {1 / ratios['q1']:.2f}x, all {1 / ratios['max']:.2f}x - "
                    f"{1 / ratios['min']:.2f}x)")
        assert batches is not None
        tables.append(batches["table"])
        data["data_only"] = batches["data"]
        headline += f"; batches alone {batches['data']['speedup']:.1f}x"
        if opts.fused_optimizer:
            headline += " (scaleloop with --fused-optimizer)"
    else:
        what, title = "overhead", f"Overhead: scaleloop's loop vs a raw PyTorch loop, {opts.workload.describe()}"
        headline = (f"scaleloop's loop takes {ratio:.3f}x the time of the raw loop "
                    f"(paired, per repetition: median {ratios['median']:.3f}, middle half {ratios['q1']:.3f} - "
                    f"{ratios['q3']:.3f}, all {ratios['min']:.3f} - {ratios['max']:.3f})")
    report = BenchReport(
        what=what, title=title, hardware=hw, slug=hardware_slug(hw, device.type), command=opts.command,
        settings={"workload": opts.workload.to_dict(), "batch_size": opts.batch_size, "epochs": opts.epochs,
                  "repeats": opts.repeats, "device": device.type, "threads": torch.get_num_threads(),
                  "mode": opts.mode, "fused_optimizer": opts.fused_optimizer,
                  "channels_last": opts.channels_last, "compile": opts.compile},
        tables=tables, quick=opts.quick, data=data)
    report.headline = headline
    report.notes = _notes(opts, raw_cfg, data_path, weights_diff)
    report.notes.append(f"scaleloop end to end (set-up, evaluation each epoch, run directory, curves): median "
                        f"{wall['median']:.2f} s per run; the raw loop does none of that.")
    return report


def _notes(opts: OverheadOptions, raw_cfg: Any, data_path: str, weights_diff: float) -> list[str]:
    """What the two loops did alike and apart, for the report's notes."""
    same = (f"Same work: both loops train on the same batches in the same order; their final weights differ by at "
            f"most {weights_diff:.2e}.")
    if opts.fused_optimizer:
        same += (" scaleloop's run used the one-kernel optimizer (--fused-optimizer), "
                 + ("and so did the raw loop." if raw_cfg.optim.fused_optimizer else
                    "the tutorial's loop PyTorch's default one, as the tutorial writes it: their rounding differs "
                    "slightly, hence a difference in the weights."))
    applied = [flag for flag, on in (("--channels-last", opts.channels_last), ("--compile", opts.compile)) if on]
    if applied:
        same += (f" {' and '.join(applied)}: applied to both loops alike (the raw loop gets the same weight and "
                 "input formats, and the same compiled model), so the baseline runs the same kernels.")
    if data_path == "gather":
        return [
            same,
            "Same data path on both sides: each batch is one index_select per tensor from the in-memory "
            "dataset (scaleloop's fast path; the raw loop does the same by hand), so the ratio measures the "
            "loop: the sampler, Batch objects, strategy calls, loss bookkeeping, learning-rate schedule, logging.",
            "Timed span, for both: the epochs' batch loops (scaleloop's RunResult.train_s). scaleloop also logs "
            "a global loss every 10 steps inside that span (a reduction and a CSV row), which the raw loop does not.",
        ]
    return [
        same,
        "The tutorial's loop: DataLoader(dataset, batch_size=B, sampler=RandomSampler(dataset, generator=g)) "
        "- the sampler shuffle=True builds - with g re-seeded every epoch so that it draws scaleloop's "
        "permutation; each batch is B __getitem__ calls and a collation, and the loss is read with "
        "loss.item() every step, as the tutorial writes it.",
    ]


def _data_only(cfg: Any, device: torch.device, opts: OverheadOptions, say: Say) -> dict[str, Any]:
    """One epoch of batches, nothing else: the tutorial's DataLoader against scaleloop's loader
    (fast path; on a GPU also with the data kept there), interleaved, and a check that they
    yield the very same batches."""
    import time

    from torch.utils.data import DataLoader, RandomSampler

    from scaleloop.data.batch import move, split
    from scaleloop.data.datasets import build_datasets
    from scaleloop.data.loader import ShardedLoader
    from scaleloop.data.sampler import StepSampler

    data = build_datasets(cfg.model_data.data, n_samples=cfg.model_data.n_samples, input_dim=cfg.model_data.input_dim, image_size=cfg.model_data.image_size,
                          seq_len=cfg.model_data.seq_len, vocab_size=cfg.model_data.vocab_size, test_fraction=cfg.model_data.test_fraction,
                          seed=cfg.optim.seed)
    dataset = data.train
    g = torch.Generator()
    tutorial = DataLoader(dataset, batch_size=cfg.optim.batch_size, sampler=RandomSampler(dataset, generator=g))
    sampler = StepSampler(len(dataset), cfg.optim.batch_size, seed=cfg.optim.seed)
    loaders = {"scaleloop fast path (index_select)": ShardedLoader(dataset, sampler, device,
                                                                     pin_memory=device.type == "cuda")}
    if device.type != "cpu":
        loaders["scaleloop fast path, data kept on the device"] = ShardedLoader(dataset, sampler, device, on_device=True)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def tutorial_epoch(epoch: int) -> float:
        g.manual_seed(cfg.optim.seed + epoch)
        sync()
        start = time.perf_counter()
        for sample in tutorial:
            move(sample, device)
        sync()
        return time.perf_counter() - start

    def loader_epoch(loader: ShardedLoader, epoch: int) -> float:
        loader.set_epoch(epoch)
        sync()
        start = time.perf_counter()
        for _batch in loader:
            pass
        sync()
        return time.perf_counter() - start

    # The same batches: the tutorial's RandomSampler, seeded per epoch, draws StepSampler's permutation.
    g.manual_seed(cfg.optim.seed)
    ours = ShardedLoader(dataset, sampler, torch.device("cpu"))
    same = all(_equal(split(a, ours.keep_target), (b[0], b[1])) for a, b in zip(tutorial, ours))
    names = ["tutorial DataLoader(shuffle=True)", *loaders]
    times: dict[str, list[float]] = {n: [] for n in names}
    repeats = max(3, opts.repeats)
    say(f"overhead (datapath): one epoch of batches, {repeats} interleaved repetitions")
    loader_epoch(next(iter(loaders.values())), 0)
    tutorial_epoch(0)
    for i in range(repeats):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            times[name].append(tutorial_epoch(i) if name == names[0] else loader_epoch(loaders[name], i))
    stats = {n: summarize(v) for n, v in times.items()}
    base = stats[names[0]]["median"]
    batches = sampler.steps_per_epoch
    rows = [{"path": n, "median_ms": 1e3 * s["median"], "per_batch_us": 1e6 * s["median"] / batches,
             "spread": s["spread"], "speedup": base / s["median"]} for n, s in stats.items()]
    table = Table("One epoch of batches alone, interleaved repetitions", [
        Column("path", "data path"), Column("median_ms", "median ms/epoch", lambda v: f"{v:.1f}"),
        Column("per_batch_us", "us/batch", lambda v: f"{v:.1f}"), Column("spread", "spread (max-min)/median", _fmt_pct),
        Column("speedup", "speed-up", lambda v: f"{v:.1f}x")], rows,
        f"{repeats} repetitions of one epoch ({len(dataset):,} samples, {batches} batches of {cfg.optim.batch_size}) onto "
        f"{device.type}; identical batches (indices and tensors) from both: {'yes' if same else 'NO'}.")
    return {"table": table, "data": {"rows": rows, "identical_batches": same, "speedup": rows[1]["speedup"],
                                     "seconds": {n: s for n, s in stats.items()}}}


def describe_threads(device: torch.device) -> str:
    return f"cpu with {threads_text(torch.get_num_threads())}" if device.type == "cpu" else str(device)


def _fmt_s(v: float) -> str:
    return f"{v:.3f}"


def _fmt_pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _equal(a: Any, b: Any) -> bool:
    """Two batches hold the same tensors in the same structure (tuples, lists, mappings)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b
