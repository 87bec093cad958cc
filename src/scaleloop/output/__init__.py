"""What a run writes and prints.

- ``rundir``: the run directory and atomic file writes.
- ``metrics``: ``metrics.csv``, ``curves.png``, number formatting.
- ``trackers``: where metrics go besides ``metrics.csv`` (``--tracker``): TensorBoard, W&B, MLflow.
- ``memory``: parameter, gradient and optimizer-state bytes per rank (``memory.json``).
- ``summary``: the end-of-run summary ``scaleloop train`` prints.
"""
