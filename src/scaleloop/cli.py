"""The ``scaleloop`` command: parses flags, builds a config, calls the library. Nothing more.

Torch is imported only inside the subcommands, so ``scaleloop --help`` answers at once.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, NoReturn, Optional, Sequence

from scaleloop.config import TrainConfig, coerce, field_types, flag, load_toml, resolve, to_toml
from scaleloop.errors import UsageError

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
        help_text = meta["help"] if "(default:" in meta["help"] else f"{meta['help']} (default: {default})"
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

    from scaleloop import dist
    from scaleloop.launch import run_under_torchrun
    from scaleloop.loop import preflight, train
    from scaleloop.checkpoint.resume import run_dir_for
    from scaleloop.rundir import default_run_dir, prepare_run_dir, write_atomic
    from scaleloop.summary import format_result

    if not dist.launched_by_torchrun():
        cfg = _auto_processes(cfg)
        if cfg.world_size > 1:
            # Check what can be checked before starting N processes, then hand the workers
            # the fully resolved config (run directory included) as a file: every worker and
            # node then trains with exactly the same settings.
            preflight(cfg)
            resuming = _check_resume(cfg)
            out = run_dir_for(cfg) or default_run_dir(cfg.model, cfg.data)
            cfg = cfg.replace(out=str(out))
            run_dir = prepare_run_dir(cfg.out, cfg.model, cfg.data, continuing=resuming)
            resolved = run_dir / "config.toml"
            write_atomic(resolved, to_toml(cfg).encode())
            code = run_under_torchrun(cfg, ["train", "--config", str(resolved)])
            if code != 0:
                raise _WorkerFailure(code)
            return 0

    env = dist.DistEnv.from_env(device=cfg.device, backend=cfg.backend)
    dist.init_process_group(env)
    try:
        result = train(cfg, env)
    finally:
        dist.destroy_process_group()
    if env.is_main:
        print(format_result(result))
    return 0


def _check_resume(cfg: TrainConfig) -> bool:
    """Before starting workers: is there a checkpoint to resume, and does it fit ``cfg``?"""
    from scaleloop.checkpoint.resume import check_compatible, find_checkpoint

    info = find_checkpoint(cfg, restarting=False, warn=lambda msg: print(f"scaleloop: {msg}", file=sys.stderr))
    if info is None:
        return False
    if isinstance(info.meta.get("config"), dict):
        check_compatible(info.meta["config"], cfg, str(info.path))
    return True


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


def cmd_env(args: argparse.Namespace) -> int:
    from scaleloop.envinfo import collect_env, format_env

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
        return cmd_env(args)
    except UsageError as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _WorkerFailure as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nscaleloop: interrupted; everything written so far is kept", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
