"""What a run writes and prints.

- ``rundir``: the run directory and atomic file writes.
- ``metrics``: ``metrics.csv``, TensorBoard scalars, ``curves.png``, number formatting.
- ``memory``: parameter, gradient and optimizer-state bytes per rank (``memory.json``).
- ``summary``: the end-of-run summary ``scaleloop train`` prints.
"""
