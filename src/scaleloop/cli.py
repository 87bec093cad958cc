"""The ``scaleloop`` command: parses flags, builds a config, calls the library. Nothing more.

Torch is imported only inside the subcommands, so ``scaleloop --help`` answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

from scaleloop.config import TrainConfig, coerce, field_types, flag, load_toml, resolve, to_toml
from scaleloop.errors import UsageError
from scaleloop.bench.cli import add_parser as add_bench_parser, run as run_bench
from scaleloop.verify.cli import add_parser as add_verify_parser, run as run_verify

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags in one line (no usage dump) with exit code 2.

    Abbreviated flags are refused: otherwise a typo such as ``--epoch 3`` would silently
    set ``--epochs``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see: {self.prog} --help)")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, grouped, each help ending with its default."""
    types = field_types()
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        group_name = meta.get("group", "training")
        group = groups.get(group_name) or groups.setdefault(group_name, parser.add_argument_group(group_name))
        default = "not set" if f.default is None else f.default
        # Help that already explains its default ("default: off") is not given a second one.
        listed = meta["help"] if not meta.get("choices") else f"{meta['help']} ({'|'.join(meta['choices'])})"
        help_text = listed if "(default:" in listed else f"{listed} (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if types[f.name] is bool:
            group.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        kwargs["metavar"] = f.name.upper()
        group.add_argument(flag(f.name), **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="scaleloop", description=(
        "Scale a plain PyTorch training loop from one CPU to many GPUs and machines, "
        "and see what happens when it does."))
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = sub.add_parser("train", help="train a model (defaults: SimpleNet on the bundled digits, best device)",
                           description="Train a model. With no flags: SimpleNet on scikit-learn's bundled "
                                       "8x8 digits, on the best device (CUDA > MPS > CPU). Flags override "
                                       "--config, which overrides the defaults.")
    train.add_argument("--config", metavar="FILE", help="TOML file of settings (keys as below, e.g. batch_size = 128)")
    _add_config_flags(train)

    tune = sub.add_parser("tune-batch", help="find the largest per-device batch that fits in accelerator memory",
                          description="Try training steps of the configured model at growing per-device "
                                      "batch sizes on the GPU, back off on out-of-memory, and print the "
                                      "largest that fits and the global --batch-size it gives. Accelerators "
                                      "only: on CPU, choose --batch-size by hand.")
    tune.add_argument("--config", metavar="FILE", help="TOML file of settings (as for train)")
    _add_config_flags(tune)

    add_verify_parser(sub, _Parser, _add_config_flags)
    add_bench_parser(sub, _Parser)

    sub.add_parser("env", help="what this machine offers: torch, devices, backends, runnable strategies",
                   description="Report Python, torch, CUDA/NCCL/Gloo/MPS availability, devices, CPU "
                               "cores, and which strategies can run here.")
    return parser


def _flag_values(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    return {k: coerce(k, v, flag(k)) for k, v in vars(args).items() if k in names}


def cmd_train(args: argparse.Namespace) -> int:
    from scaleloop.checkpoint.resume import config_for_resume

    file_values = load_toml(args.config) if args.config else {}
    # Resuming a run starts from that run's saved settings; flags still override them.
    cfg = config_for_resume(file_values, _flag_values(args))

    from scaleloop.runtime import dist
    from scaleloop.runtime.torchrun import run_under_torchrun
    from scaleloop.loop.training import preflight, train
    from scaleloop.checkpoint.resume import continues_run, run_dir_for
    from scaleloop.output.rundir import default_run_dir, prepare_run_dir, write_atomic
    from scaleloop.output.summary import format_result

    # Started by torchrun or srun: this process is one worker. Otherwise it is the launcher.
    if not (dist.launched_by_torchrun() or dist.launched_by_slurm()):
        cfg = _auto_processes(cfg)
        if cfg.world_size > 1:
            # Check what can be checked before starting N processes, then hand the workers
            # the fully resolved config (run directory included) as a file: every worker and
            # node then trains with exactly the same settings.
            preflight(cfg)
            source = _check_resume(cfg)
            out = run_dir_for(cfg) or default_run_dir(cfg.model, cfg.data)
            cfg = cfg.replace(out=str(out))
            run_dir = prepare_run_dir(cfg.out, cfg.model, cfg.data,
                                      continuing=source is not None and continues_run(out, source))
            resolved = run_dir / "config.toml"
            write_atomic(resolved, to_toml(cfg).encode())
            try:
                code = run_under_torchrun(cfg, ["train", "--config", str(resolved)])
            except KeyboardInterrupt:
                raise _Interrupted(run_dir) from None
            if code == EXIT_INTERRUPTED or code < 0:
                raise _Interrupted(run_dir)
            if code != 0:
                raise _WorkerFailure(code)
            return 0
        # Named now, so that an interrupted run can say where to resume it from.
        out = run_dir_for(cfg) or default_run_dir(cfg.model, cfg.data)
        cfg = cfg.replace(out=str(out))

    env = dist.DistEnv.from_env(device=cfg.device, backend=cfg.backend)
    dist.init_process_group(env)
    try:
        result = train(cfg, env)
    except KeyboardInterrupt:
        raise _Interrupted(Path(cfg.out) if cfg.out and env.is_main else None) from None
    finally:
        dist.destroy_process_group()
    if env.is_main:
        print(format_result(result))
    return 0


def _check_resume(cfg: TrainConfig) -> Optional[Path]:
    """Before starting workers: the checkpoint to resume (None: a fresh start), checked against ``cfg``."""
    from scaleloop.checkpoint.resume import check_compatible, find_checkpoint

    info = find_checkpoint(cfg, restarting=False, warn=lambda msg: print(f"scaleloop: {msg}", file=sys.stderr))
    if info is None:
        return None
    if isinstance(info.meta.get("config"), dict):
        check_compatible(info.meta["config"], cfg, str(info.path))
    return info.path


class _Interrupted(Exception):
    """Ctrl-C (or SIGINT/SIGTERM of the workers); says how to continue if a checkpoint exists."""

    def __init__(self, run_dir: Optional[Path]) -> None:
        from scaleloop.checkpoint.store import CHECKPOINTS_DIR, list_checkpoints

        text = "interrupted; everything written so far is kept"
        if run_dir is not None and list_checkpoints(run_dir / CHECKPOINTS_DIR):
            text += f"; continue from the last checkpoint with: scaleloop train --out {run_dir}"
        super().__init__(text)


class _WorkerFailure(Exception):
    """The workers started under torchrun failed; their own messages were already printed."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the worker processes failed (torchrun exit code {code}); the messages above say why")
        self.code = code


def _auto_processes(cfg: TrainConfig) -> TrainConfig:
    """``--strategy auto`` on a machine with several GPUs: one DDP process per GPU."""
    if cfg.strategy != "auto" or cfg.world_size > 1 or cfg.device not in ("auto", "cuda"):
        return cfg
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return cfg.replace(nproc=gpus, strategy="ddp") if gpus > 1 else cfg


def cmd_tune_batch(args: argparse.Namespace) -> int:
    from scaleloop.loop.tune import tune_batch_command

    file_values = load_toml(args.config) if args.config else {}
    cfg = _auto_processes(resolve(file_values, _flag_values(args)))
    print(tune_batch_command(cfg))
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
        return cmd_env(args)
    except UsageError as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _WorkerFailure as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return 1
    except _Interrupted as exc:
        print(f"\nscaleloop: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("\nscaleloop: interrupted; everything written so far is kept", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
