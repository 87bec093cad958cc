"""``scaleloop tune-batch``: the largest per-device batch that fits, and the ``--batch-size`` it gives."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, Optional

from scaleloop.commands.cmdline import add_config_flags, flag_values, help_tiers
from scaleloop.config import TrainConfig, common_fields, load_toml, resolve

if TYPE_CHECKING:
    from scaleloop.plan.tune import TuneReport


def register(subparsers: Any) -> None:
    """Add ``tune-batch`` and the training flags to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "tune-batch", help="find the largest per-device batch that fits in accelerator memory",
        description="Try training steps of the configured model at growing per-device batch sizes on the "
                    "GPU, back off on out-of-memory, and print the largest that fits and the global "
                    "--batch-size it gives. Accelerators only: on CPU, choose --batch-size by hand.")
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings (as for train)")
    add_config_flags(parser)
    help_tiers(parser, ("config", *common_fields()))


def run(args: argparse.Namespace) -> int:
    from scaleloop.launching.launcher import auto_processes

    file_values = load_toml(args.config) if args.config else {}
    cfg = auto_processes(resolve(file_values, flag_values(args)))
    print(tune_batch_command(cfg))
    return 0


def tune_batch_command(cfg: Any) -> str:
    """Run the search for ``cfg`` and return the report to print."""
    from scaleloop.plan.tune import tune_batch

    return format_report(cfg, tune_batch(cfg))


def format_report(cfg: "TrainConfig", report: "TuneReport") -> str:
    """The text ``tune_batch_command`` prints: every try, the limit, and the ``--batch-size`` to use."""
    search = report.search
    lines = [f"scaleloop tune-batch: {cfg.model_data.model} on {cfg.model_data.data}, {cfg.optim.optimizer}, "
             f"{cfg.parallel.precision}, on {report.device}",
             "  per-device batch  training step"]
    for t in search.trials:
        peak = f" (peak {_gib(t.peak_bytes)})" if t.peak_bytes is not None else ""
        lines.append(f"  {t.batch:>16,}  {'fits' if t.fits else 'out of memory'}{peak}")
    split = (f"{report.workers} worker(s) x {report.accumulate} accumulation step(s) x "
             f"{search.max_batch:,} per device")
    if search.capped:
        lines.append(f"every per-device batch up to {search.cap:,} fits, and a larger one would hold more than "
                     f"all {report.train_samples:,} training samples: memory does not limit the batch here, "
                     f"so choose it for the optimisation (any --batch-size up to {report.batch_size} = {split})")
        return "\n".join(lines)
    peak = next((t.peak_bytes for t in search.trials if t.batch == search.max_batch), None)
    of_total = f" of {_gib(report.total_bytes)}" if report.total_bytes else ""
    lines.append(f"largest per-device batch that fits: {search.max_batch:,}"
                 + (f" (peak {_gib(peak)}{of_total})" if peak is not None else ""))
    lines.append(f"use --batch-size {report.batch_size} (= {split})")
    if report.workers > 1 or cfg.parallel.strategy == "dp":
        lines.append("note: measured on one device without DDP, whose gradient buckets hold about one more "
                     "copy of the gradients (and DataParallel gathers outputs on GPU 0): leave some headroom")
    return "\n".join(lines)


def _gib(n: Optional[int]) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"
