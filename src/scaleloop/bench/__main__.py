"""``python -m scaleloop.bench devices|scaling|...`` is ``scaleloop bench devices|scaling|...``: same parser,
same exit codes. (An entry point, run and never imported: the one module of ``bench`` that sits above it.)"""
import sys

from scaleloop.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
