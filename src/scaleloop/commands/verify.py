"""The ``verify`` subcommand: its flags (registered on the CLI's subparsers) and its entry point.

Like the rest of the CLI this module imports no torch: ``scaleloop --help`` stays fast, and
the work starts in :func:`run`.
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from scaleloop.config import TrainConfig, load_toml, resolve
from scaleloop.errors import UsageError
from scaleloop.commands.cmdline import flag_values
from scaleloop.verify.options import CHECKS, DEFAULT_STEPS, VerifyOptions, parse_checks

DESCRIPTION = (
    "Prove on your own model that N processes train the same model as one. Runs --steps K "
    "optimizer steps as 1 process with the global --batch-size B and as --nproc N processes "
    "(default here: 2, with --strategy ddp), takes every step again in 1 process from the N "
    "processes' state before it (lock-step), compares each step's loss, gradients, parameters and "
    "optimizer state against tolerances for the --precision, and names the cause when they differ "
    "(BatchNorm without --sync-batchnorm, dropout, a loss normalised per micro-batch, unused "
    "parameters, padded samples). --check sync hashes every tensor on every rank; --check data "
    "audits each rank's batches and each epoch's coverage; --explain shows one step rank by "
    "rank. Exit code: 0 pass, 1 fail, 2 bad input, 130 interrupted.")


# What ``verify --help`` shows: verify's own options and the training flags a first comparison
# sets; ``--help-all`` shows every training flag too.
VERIFY_COMMON = ("config", "steps", "check", "explain", "model", "data", "batch_size",
                 "nproc", "strategy", "device", "precision")


def add_parser(subparsers: Any, parser_class: type, add_config_flags: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """Register ``verify`` on the CLI's ``subparsers``; ``add_config_flags`` adds the TrainConfig flags.

    ``parser_class`` is the CLI's parser class (one-line errors, exit 2); the subparsers must
    have been created with it, so that bad verify flags are reported like any other.
    """
    parser = subparsers.add_parser(
        "verify", help="check that N processes train the same model as 1, and show what each rank does",
        description=DESCRIPTION)
    if not isinstance(parser, parser_class):
        raise TypeError(f"create the subparsers with parser_class={parser_class.__name__}")
    group = parser.add_argument_group("verify")
    group.add_argument("--config", metavar="FILE", help="TOML file of settings (as for train)")
    group.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="K",
                       help=f"optimizer steps to compare (default: {DEFAULT_STEPS})")
    group.add_argument("--check", action="append", metavar="CHECK",
                       help=f"what to check: {', '.join(CHECKS)}, or all; repeat or comma-separate "
                            "(default: equivalence)")
    group.add_argument("--explain", nargs="?", type=int, const=1, default=None, metavar="STEP",
                       help="print a per-rank account of step STEP (default 1): samples, local loss, the "
                            "first layer's gradient norm before and after synchronisation")
    group.add_argument("--tolerance", type=float, metavar="X",
                       help="largest parameter difference, relative to the largest weight, that counts as "
                            "equal (default: 1e-5 fp32, 1e-2 bf16, 5e-3 fp16; loss and gradient tolerances "
                            "scale with it)")
    group.add_argument("--report", metavar="DIR",
                       help="keep everything recorded (per-step parameters and gradients of both runs, "
                            "the workers' log) in DIR (default: a temporary directory)")
    group.add_argument("--plot", metavar="FILE",
                       help="draw the loss of both runs and their parameter difference per step into FILE "
                            "(PNG); with --report DIR, DIR/verify.png is drawn anyway")
    add_config_flags(parser)
    # Verify's own defaults for two training flags (resolve_verify): said where they are listed.
    for action in parser._actions:
        if action.dest == "nproc":
            action.help = "worker processes on this machine (default here: 2, or the --mesh's size)"
        elif action.dest == "strategy" and action.help:
            action.help = action.help.replace("(default: auto)", "(default here: ddp, or mesh with --mesh)")
    from scaleloop.commands.cmdline import help_tiers

    help_tiers(parser, VERIFY_COMMON)
    return parser


def resolve_verify(args: argparse.Namespace) -> tuple[TrainConfig, VerifyOptions]:
    """The distributed run's config and the verify options, validated; UsageError for bad input."""
    from scaleloop.runtime import dist

    if dist.launched_by_torchrun() or dist.launched_by_slurm():
        raise UsageError("scaleloop verify starts its own worker processes; run it as one plain process, "
                         "not under torchrun or srun")
    file_values = load_toml(args.config) if args.config else {}
    given = {**file_values, **flag_values(args)}
    forced: dict[str, Any] = {"max_restarts": 0, "progress": False}   # verify's own, whatever was given
    strategy = given.get("strategy", "auto")
    if strategy == "single":
        raise UsageError("--strategy single has nothing to compare with one process; use ddp, allreduce or dp")
    if strategy != "dp":
        # Verify's defaults where train's do not fit: a comparison needs several processes.
        mesh = given.get("mesh")
        if "nproc" not in given:
            from scaleloop.runtime.mesh import MeshSpec

            # --mesh: its ranks, and the mesh strategy
            forced["nproc"] = MeshSpec.parse(mesh).world_size if mesh is not None else 2
        forced["strategy"] = ("mesh" if mesh is not None else "ddp") if strategy == "auto" else strategy
    cfg = resolve(file_values, {**flag_values(args), **forced})  # checks every value, and that the batch splits
    if cfg.launch.nnodes > 1:
        raise UsageError("scaleloop verify runs on one machine: drop --nnodes (use --nproc N)")
    if cfg.parallel.strategy != "dp" and cfg.launch.nproc < 2:
        raise UsageError(f"--nproc {cfg.launch.nproc} would compare one process with itself; use --nproc 2 or more")
    opts = VerifyOptions(steps=args.steps, checks=parse_checks(args.check), explain_step=args.explain,
                         tolerance=args.tolerance, report=args.report, plot=args.plot).validate()
    return cfg, opts


def run(args: argparse.Namespace) -> int:
    """Execute ``scaleloop verify``: 0 if every check passed, 1 if one failed (UsageError: bad input;
    Interrupted: Ctrl-C)."""
    cfg, opts = resolve_verify(args)
    from scaleloop.launching.preflight import preflight
    from scaleloop.verify.command import verify

    preflight(cfg)
    try:
        return verify(cfg, opts)
    except KeyboardInterrupt:
        # Ctrl-C here or in the workers: no verdict (a script would read "FAIL" as "not equivalent");
        # the temporary records are gone by now, --report DIR keeps them.
        from scaleloop.launching.launcher import Interrupted

        raise Interrupted(None, kept=f"records kept in {opts.report}" if opts.report else None) from None


def register(subparsers: Any) -> None:
    """Add ``verify`` to the CLI's subparsers (created with ``Parser``)."""
    from scaleloop.commands.cmdline import Parser, add_config_flags

    add_parser(subparsers, Parser, add_config_flags)
