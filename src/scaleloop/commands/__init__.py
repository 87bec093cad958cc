"""One module per ``scaleloop`` subcommand: its flags and its entry point. ``scaleloop.cli`` dispatches.

- ``train``: ``scaleloop train``; ``tune_batch``: ``scaleloop tune-batch``; ``plan``: ``scaleloop plan``;
- ``verify``: ``scaleloop verify``; ``bench``: ``scaleloop bench`` and its commands;
- ``doctor``: ``scaleloop doctor RUN_DIR``; ``plot``: ``scaleloop plot RUN ...``; ``env``: ``scaleloop env``;
- ``sample``: ``scaleloop sample RUN_DIR --prompt TEXT``, text from a trained language model;
- ``cmdline``: the parts they share: the one-line-error parser, the config flags, exit codes.
"""
