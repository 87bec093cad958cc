"""``python -m scaleloop`` is the ``scaleloop`` command."""
import sys

from scaleloop.cli import main

sys.exit(main())
