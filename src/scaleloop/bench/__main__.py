"""``python -m scaleloop.bench devices|scaling|...`` is ``scaleloop bench devices|scaling|...``."""
import sys

from scaleloop.bench.cli import main

sys.exit(main())
