"""The ``scaleloop`` command: parses flags and dispatches to one module per subcommand. Nothing more.

Each subcommand is ``scaleloop.commands.<name>``: its ``register`` adds its flags, its ``run``
does the work. Torch is imported only inside ``run``, so ``scaleloop --help`` answers at once.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Optional, Sequence

from scaleloop.commands import bench, doctor, env, plan, plot, sample, train, tune_batch, verify
from scaleloop.commands.cmdline import EXIT_INTERRUPTED, EXIT_USAGE, Parser
from scaleloop.errors import UsageError
from scaleloop.launching.launcher import Interrupted, WorkersFailed
from scaleloop.runtime.exiting import exit_process
from scaleloop.runtime.preempt import EXIT_PREEMPTED, Preempted

# The subcommands, in the order ``scaleloop --help`` lists them.
COMMANDS = {"train": train, "tune-batch": tune_batch, "plan": plan, "verify": verify, "bench": bench, "doctor": doctor,
            "plot": plot, "sample": sample, "env": env}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="scaleloop", description=(
        "Scale a plain PyTorch training loop from one CPU to many GPUs and machines, "
        "and see what happens when it does."))
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS.values():
        command.register(sub)
    return parser


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
        return COMMANDS[args.command].run(args)
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
    except BrokenPipeError:
        # The reader of our output went away (`scaleloop doctor RUN | head`): not an error of
        # ours. Later writes (Python's own flush at exit) go nowhere instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def command() -> NoReturn:
    """The ``scaleloop`` console script: :func:`main`, then the end of the process
    (``scaleloop.runtime.exiting`` says why it is not a plain ``sys.exit``)."""
    exit_process(main())


if __name__ == "__main__":  # pragma: no cover
    command()
