"""``python -m scaleloop`` is the ``scaleloop`` command."""
from scaleloop.cli import main
from scaleloop.runtime.exiting import exit_process

exit_process(main())
