"""``python tools/plan_validate [flags]``: the plan against CPU measurement (``validate.main``)."""
import sys
from pathlib import Path

# Run as a directory, Python puts this folder first on the path; its parent, tools/, is what
# makes ``plan_validate`` importable as a package (and keeps its modules' names out of the top level).
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from plan_validate.validate import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
