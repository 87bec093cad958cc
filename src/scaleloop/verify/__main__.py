"""``python -m scaleloop.verify [flags]`` is ``scaleloop verify [flags]``: same parser, same exit codes."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from scaleloop.cli import main as cli_main


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli_main(["verify", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
