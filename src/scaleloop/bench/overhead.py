"""``scaleloop bench overhead``: scaleloop's loop against a hand-written PyTorch loop.

Both train the same model on the same data, seed and batch, in the same process, with the
same threads. The repetitions are interleaved (raw, scaleloop, scaleloop, raw, ...) so that
whatever else changes on the machine during the benchmark (clock boost, another process)
hits both alike. The headline is the ratio of the median training times: 1.00 would mean
scaleloop's loop costs nothing over the plain loop.

What is timed is training only, the same span for both: from the first batch of an epoch
to the end of its last optimizer step, summed over epochs. scaleloop's end-to-end time also
includes what the plain loop does not do (evaluation, run directory, curves); it is reported
separately.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from scaleloop.bench.hardware import describe_hardware, hardware_slug, threads_text
from scaleloop.bench.rawloop import raw_train
from scaleloop.bench.report import BenchReport, Column, Table, fmt_rate, fmt_ratio
from scaleloop.bench.stats import summarize
from scaleloop.bench.workload import Workload
from scaleloop.errors import UsageError

Say = Callable[[str], None]


@dataclass(frozen=True)
class OverheadOptions:
    workload: Workload
    batch_size: int = 64
    epochs: int = 5
    repeats: int = 7
    threads: Optional[int] = None     # CPU threads for both loops (None: torch's default)
    quick: bool = False
    command: str = "scaleloop bench overhead"


def run_overhead(opts: OverheadOptions, say: Say) -> BenchReport:
    previous = torch.get_num_threads()
    if opts.threads and opts.workload.device == "cpu":
        torch.set_num_threads(opts.threads)
    try:
        return _run_overhead(opts, say)
    finally:
        torch.set_num_threads(previous)


def _run_overhead(opts: OverheadOptions, say: Say) -> BenchReport:
    from scaleloop.dist import DistEnv
    from scaleloop.loop import train

    hw = describe_hardware()   # first: its load average is the one the measurements met
    device = torch.device(opts.workload.device)
    cfg = opts.workload.to_config(strategy="single", batch_size=opts.batch_size, epochs=opts.epochs,
                                  test_fraction=0.2)
    env = DistEnv(device=device)
    reps: list[dict[str, Any]] = []
    weights_diff = None
    with tempfile.TemporaryDirectory(prefix="scaleloop-bench-overhead-") as tmp:
        def scaleloop_run(i: int):
            return train(cfg.replace(out=f"{tmp}/run{i}"), env, log=lambda _m: None)

        say("overhead: warm-up (one run of each loop, not counted)")
        raw, ours = raw_train(cfg, device), scaleloop_run(-1)
        if not ours.in_memory_data:
            raise UsageError(f"--data {cfg.data}: the overhead bench compares in-memory datasets only")
        saved = torch.load(Path(ours.run_dir) / "model.pt", weights_only=True)
        weights_diff = max(float((saved[k].float() - raw.state[k].float()).abs().max()) for k in saved)
        for i in range(opts.repeats):
            # Alternate which loop goes first, so neither always runs on a warmer (or hotter) machine.
            order = ("raw", "scaleloop") if i % 2 == 0 else ("scaleloop", "raw")
            rep: dict[str, Any] = {"repetition": i + 1, "first": order[0]}
            for which in order:
                if which == "raw":
                    r = raw_train(cfg, device)
                    rep.update(raw_s=r.train_s, raw_samples=r.samples)
                else:
                    s = scaleloop_run(i)
                    rep.update(scaleloop_s=s.train_s, scaleloop_wall_s=s.wall_s, scaleloop_samples=s.samples)
            rep["ratio"] = rep["scaleloop_s"] / rep["raw_s"]
            reps.append(rep)
            say(f"  repetition {i + 1}/{opts.repeats}: raw {rep['raw_s']:.3f} s, scaleloop {rep['scaleloop_s']:.3f} s "
                f"(x{rep['ratio']:.3f})")

    raw_s = summarize([r["raw_s"] for r in reps])
    sl_s = summarize([r["scaleloop_s"] for r in reps])
    ratios = summarize([r["ratio"] for r in reps])
    wall = summarize([r["scaleloop_wall_s"] for r in reps])
    samples = reps[0]["raw_samples"]
    ratio = sl_s["median"] / raw_s["median"]
    rows = [
        {"loop": "raw PyTorch (hand-written)", "median_s": raw_s["median"], "min_s": raw_s["min"],
         "max_s": raw_s["max"], "spread": raw_s["spread"], "samples_per_s": samples / raw_s["median"],
         "ratio": 1.0},
        {"loop": "scaleloop (scaleloop.loop.train)", "median_s": sl_s["median"], "min_s": sl_s["min"],
         "max_s": sl_s["max"], "spread": sl_s["spread"], "samples_per_s": samples / sl_s["median"],
         "ratio": ratio},
    ]
    table = Table("Training time, interleaved repetitions", [
        Column("loop", "loop"), Column("median_s", "median s", _fmt_s), Column("min_s", "min s", _fmt_s),
        Column("max_s", "max s", _fmt_s), Column("spread", "spread (max-min)/median", lambda v: f"{100 * v:.1f}%"),
        Column("samples_per_s", "samples/s", fmt_rate), Column("ratio", "time / raw", lambda v: f"{v:.3f}")], rows,
        f"{opts.repeats} repetitions of {opts.epochs} epoch(s) each ({samples:,} samples), "
        f"{opts.workload.describe()}, batch {opts.batch_size}, {describe_threads(device)}.")
    report = BenchReport(
        what="overhead", title=f"Overhead: scaleloop's loop vs a raw PyTorch loop, {opts.workload.describe()}",
        hardware=hw, slug=hardware_slug(hw, device.type), command=opts.command,
        settings={"workload": opts.workload.to_dict(), "batch_size": opts.batch_size, "epochs": opts.epochs,
                  "repeats": opts.repeats, "device": device.type, "threads": torch.get_num_threads()},
        tables=[table], quick=opts.quick,
        data={"ratio": ratio, "ratio_per_repetition": ratios, "raw_s": raw_s, "scaleloop_s": sl_s,
              "scaleloop_wall_s": wall, "final_weights_max_abs_diff": weights_diff, "repetitions": reps})
    report.headline = (f"scaleloop's loop takes {ratio:.3f}x the time of the raw loop "
                       f"(per-repetition ratios {ratios['min']:.3f} - {ratios['max']:.3f})")
    report.notes = [
        f"Same work: after the same training both loops' final weights differ by at most {weights_diff:.2e}.",
        "Timed span, for both: the epochs' batch loops (scaleloop's RunResult.train_s). scaleloop also logs a "
        "global loss every 10 steps inside that span (a reduction and a CSV row), which the raw loop does not.",
        f"scaleloop end to end (set-up, evaluation each epoch, run directory, curves): median {wall['median']:.2f} s "
        "per run; the raw loop does none of that.",
    ]
    return report


def describe_threads(device: torch.device) -> str:
    return f"cpu with {threads_text(torch.get_num_threads())}" if device.type == "cpu" else str(device)


def _fmt_s(v: float) -> str:
    return f"{v:.3f}"
