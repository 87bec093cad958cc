"""The ``scaleloop`` command: parses flags, builds a config, calls the library. Nothing more.

Torch is imported only inside the subcommands, so ``scaleloop --help`` answers at once.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from scaleloop.config import load_toml, resolve
from scaleloop.errors import UsageError
from scaleloop.runtime.cmdline import EXIT_INTERRUPTED, EXIT_USAGE, Parser, add_config_flags, flag_values
from scaleloop.runtime.launcher import Interrupted, WorkersFailed, auto_processes, launch_train
from scaleloop.runtime.preempt import EXIT_PREEMPTED, Preempted
from scaleloop.bench.cli import add_parser as add_bench_parser, run as run_bench
from scaleloop.verify.cli import add_parser as add_verify_parser, run as run_verify


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="scaleloop", description=(
        "Scale a plain PyTorch training loop from one CPU to many GPUs and machines, "
        "and see what happens when it does."))
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    train = sub.add_parser("train", help="train a model (defaults: SimpleNet on the bundled digits, best device)",
                           description="Train a model. With no flags: SimpleNet on scikit-learn's bundled "
                                       "8x8 digits, on the best device (CUDA > MPS > CPU). Flags override "
                                       "--config, which overrides the defaults.")
    train.add_argument("--config", metavar="FILE", help="TOML file of settings (keys as below, e.g. batch_size = 128)")
    add_config_flags(train)

    tune = sub.add_parser("tune-batch", help="find the largest per-device batch that fits in accelerator memory",
                          description="Try training steps of the configured model at growing per-device "
                                      "batch sizes on the GPU, back off on out-of-memory, and print the "
                                      "largest that fits and the global --batch-size it gives. Accelerators "
                                      "only: on CPU, choose --batch-size by hand.")
    tune.add_argument("--config", metavar="FILE", help="TOML file of settings (as for train)")
    add_config_flags(tune)

    add_verify_parser(sub, Parser, add_config_flags)
    add_bench_parser(sub, Parser)

    doctor = sub.add_parser("doctor", help="read a run directory: what happened, the newest checkpoint, how to continue",
                            description="Read a run directory (the --out of a run) and say in a few lines "
                                        "whether the run finished, was interrupted, failed (which rank, with "
                                        "what, where) or stalled (which rank, stuck where), the newest "
                                        "checkpoint that verifies, and the command that continues it.")
    doctor.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (e.g. runs/20261125-101500-simplenet-digits)")

    sub.add_parser("env", help="what this machine offers: torch, devices, backends, runnable strategies",
                   description="Report Python, torch, CUDA/NCCL/Gloo/MPS availability, devices, CPU "
                               "cores, and which strategies can run here.")
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from scaleloop.checkpoint.resume import config_for_resume

    file_values = load_toml(args.config) if args.config else {}
    # Resuming a run starts from that run's saved settings; flags still override them.
    result = launch_train(config_for_resume(file_values, flag_values(args)))
    if result is not None:
        from scaleloop.output.summary import format_result

        print(format_result(result))
    return 0


def cmd_tune_batch(args: argparse.Namespace) -> int:
    from scaleloop.loop.tune import tune_batch_command

    file_values = load_toml(args.config) if args.config else {}
    cfg = auto_processes(resolve(file_values, flag_values(args)))
    print(tune_batch_command(cfg))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from pathlib import Path

    from scaleloop.doctor import diagnose, format_diagnosis

    print(format_diagnosis(diagnose(Path(args.run_dir))))
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from scaleloop.runtime.envinfo import collect_env, format_env

    print(format_env(collect_env()))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``scaleloop`` console script and ``python -m scaleloop``."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.version:
            from scaleloop import __version__

            print(f"scaleloop {__version__}")
            return 0
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        if args.command == "train":
            return cmd_train(args)
        if args.command == "tune-batch":
            return cmd_tune_batch(args)
        if args.command == "verify":
            return run_verify(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "doctor":
            return cmd_doctor(args)
        return cmd_env(args)
    except UsageError as exc:
        if not exc.shown:  # a worker under --nproc may have said it on this console already
            print(f"scaleloop: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except WorkersFailed as exc:  # the launcher's short report, already worded
        print(exc, file=sys.stderr)
        return 1
    except Interrupted as exc:
        print(f"\nscaleloop: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Preempted as exc:  # a stop signal: the checkpoint is written; the line says how to continue
        print(f"scaleloop: {exc}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("\nscaleloop: interrupted; everything written so far is kept", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
