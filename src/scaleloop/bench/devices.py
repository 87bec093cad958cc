"""``scaleloop bench devices``: the tutorial's timing of one short training on CPU, CUDA and MPS.

The same ``TrainConfig`` (model, data, batch, epochs, seed) is trained with ``scaleloop.loop.training.train``
on every device this machine has, one warm-up run and then ``repeats`` timed runs each; the
table gives the median training time and samples/s, and the speed-up over the CPU. Devices
that are missing are listed as such rather than left out, so a table from a laptop and one
from a GPU server have the same rows.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from scaleloop.bench.hardware import describe_hardware, hardware_slug, threads_text
from scaleloop.bench.report import BenchReport, Column, Table, fmt_rate, fmt_ratio
from scaleloop.bench.stats import summarize
from scaleloop.bench.workload import Workload

Say = Callable[[str], None]
DEVICES = ("cpu", "cuda", "mps")


@dataclass(frozen=True)
class DevicesOptions:
    workload: Workload
    batch_size: int = 256
    epochs: int = 3
    repeats: int = 3
    threads: Optional[int] = None     # CPU threads (None: torch's default, as scaleloop train uses)
    quick: bool = False
    command: str = "scaleloop bench devices"


def available(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_available()
    if device == "mps":
        return torch.backends.mps.is_available()
    return True


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if device == "cpu":
        from scaleloop.bench.hardware import cpu_model

        return f"{cpu_model()} ({threads_text(torch.get_num_threads())})"
    return "Apple GPU (MPS)"


def time_training(opts: DevicesOptions, device: str) -> dict[str, Any]:
    """Warm up, then train ``repeats`` times on ``device``; medians and spreads of the runs."""
    from scaleloop.runtime.dist import DistEnv
    from scaleloop.loop.training import train

    cfg = opts.workload.to_config(device=device, strategy="single", batch_size=opts.batch_size,
                                  epochs=opts.epochs, test_fraction=0.2)
    env = DistEnv(device=torch.device(device))
    runs = []
    previous = torch.get_num_threads()
    if device == "cpu" and opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="scaleloop-bench-devices-") as tmp:
            for i in range(opts.repeats + 1):   # the first run pays one-off start-up costs: not counted
                result = train(cfg.replace(out=f"{tmp}/run{i}"), env, log=lambda _msg: None)
                if i:
                    runs.append(result)
        name = device_name(device)
    finally:
        torch.set_num_threads(previous)
    train_s = summarize([r.train_s for r in runs])
    return {"device": device, "available": True, "name": name, "repeats": opts.repeats,
            "train_s": train_s["median"], "train_s_min": train_s["min"], "train_s_max": train_s["max"],
            "spread": train_s["spread"], "samples": runs[0].samples,
            "samples_per_s": summarize([r.samples_per_s for r in runs])["median"],
            "train_loss": runs[-1].train_loss,
            "test_accuracy": runs[-1].test.accuracy if runs[-1].test else None}


def run_devices(opts: DevicesOptions, say: Say) -> BenchReport:
    hw = describe_hardware()   # first: its load average is the one the measurements met
    rows: list[dict[str, Any]] = []
    for device in DEVICES:
        if not available(device):
            say(f"devices: {device}: not available here")
            rows.append({"device": device, "available": False, "name": "not available on this machine"})
            continue
        say(f"devices: {device}: 1 warm-up + {opts.repeats} timed runs of {opts.epochs} epoch(s)")
        row = time_training(opts, device)
        say(f"  {device}: {row['train_s']:.2f} s, {row['samples_per_s']:,.0f} samples/s")
        rows.append(row)
    cpu = next(r for r in rows if r["device"] == "cpu")
    for r in rows:
        if r.get("available"):
            r["speedup"] = r["samples_per_s"] / cpu["samples_per_s"]
    best = max((r for r in rows if r.get("available")), key=lambda r: r["samples_per_s"])
    table = Table("Same training on each device", [
        Column("device", "device"), Column("name", "name"), Column("train_s", "training s (median)", _fmt_s),
        Column("range", "min - max s"), Column("samples_per_s", "samples/s", fmt_rate),
        Column("speedup", "vs CPU", fmt_ratio), Column("train_loss", "final train loss", lambda v: f"{v:.4f}")],
        [dict(r, range=f"{r['train_s_min']:.2f} - {r['train_s_max']:.2f}" if r.get("available") else None)
         for r in rows],
        f"{opts.workload.describe()}, batch {opts.batch_size}, {opts.epochs} epoch(s) per run; training time "
        "excludes evaluation and start-up; median of the timed runs.")
    report = BenchReport(
        what="devices", title=f"Devices: {opts.workload.describe()}", hardware=hw,
        slug=hardware_slug(hw, "cuda" if hw["gpus"] else "mps" if hw["mps_available"] else "cpu"),
        command=opts.command,
        settings={"workload": opts.workload.to_dict(), "batch_size": opts.batch_size, "epochs": opts.epochs,
                  "repeats": opts.repeats},
        tables=[table], quick=opts.quick, data={"devices": rows})
    report.headline = (f"fastest here: {best['device']} at {best['samples_per_s']:,.0f} samples/s"
                       + (f" ({best['speedup']:.2f}x the CPU)" if best["device"] != "cpu" else ""))
    threads = f"{threads_text(opts.threads)} (--threads)" if opts.threads else "torch's default thread count"
    report.notes = [f"The CPU runs with {threads}; each device trains from the same seed, so the runs do the "
                    "same work."]
    if not hw["gpus"]:
        report.notes.append("No GPU was available on this machine: the CUDA row is empty, not zero.")
    return report


def _fmt_s(v: float) -> str:
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"
