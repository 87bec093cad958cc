"""``python -m scaleloop.verify [flags]``: the ``verify`` subcommand on its own.

The same parser and exit codes as ``scaleloop verify`` (0 pass, 1 fail, 2 bad input).
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from scaleloop.cli import EXIT_INTERRUPTED, EXIT_USAGE, _add_config_flags, _Parser
from scaleloop.errors import UsageError
from scaleloop.verify.cli import add_parser, run


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _Parser(prog="scaleloop")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    add_parser(sub, _Parser, _add_config_flags)
    try:
        return run(parser.parse_args(["verify", *(sys.argv[1:] if argv is None else argv)]))
    except UsageError as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nscaleloop: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
