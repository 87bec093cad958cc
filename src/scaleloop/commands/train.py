"""``scaleloop train``: its flags, and the run it starts (here, or as workers under torchrun)."""
from __future__ import annotations

import argparse
from typing import Any

from scaleloop.commands.cmdline import add_config_flags, flag_values, help_tiers
from scaleloop.config import SETTINGS, common_fields, config_for_resume, load_toml
from scaleloop.errors import UsageError


def register(subparsers: Any) -> None:
    """Add ``train`` and its flags (one per setting of ``TrainConfig``'s sections) to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "train", help="train a model (defaults: SimpleNet on the bundled digits, best device)",
        description="Train a model. With no flags: SimpleNet on scikit-learn's bundled 8x8 digits, on the "
                    "best device (CUDA > MPS > CPU). Flags override --config, which overrides the defaults.")
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings (keys as below, e.g. batch_size = 128)")
    add_config_flags(parser)
    help_tiers(parser, ("config", *common_fields()))


def run(args: argparse.Namespace) -> int:
    """Train; the launcher's process prints the summary (workers under torchrun print their own)."""
    from scaleloop.launching.console import kept_console
    from scaleloop.launching.launcher import launch_train

    file_values = load_toml(args.config) if args.config else {}
    typed = {name: value for name, value in vars(args).items() if name in SETTINGS}   # as typed, "auto" too
    if typed.get("nproc") == "auto":   # one process a GPU, else 1 (launching.jobs)
        from scaleloop.launching.jobs import processes_a_machine

        args.nproc = str(processes_a_machine("auto"))
    elif typed.get("nproc") is not None and not str(typed["nproc"]).strip().isdigit():
        raise UsageError(f"--nproc must be a whole number of processes or auto, got {typed['nproc']!r}")
    flags = flag_values(args)
    # Output piped into `head`: the run trains on once the reader has gone (launching.console).
    with kept_console():
        # Resuming a run starts from that run's saved settings; flags still override them.
        result = launch_train(config_for_resume(file_values, flags), given=typed)
        # A run with nothing left to train has said so in its one line: no summary of no steps.
        if result is not None and not result.nothing_left:
            from scaleloop.loop.text import format_result

            print(format_result(result))
    return 0
