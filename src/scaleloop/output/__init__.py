"""What a run writes and prints.

- ``settings``: ``OutputSettings``, the config's output section, and its checks.
- ``rundir``: the run directory (what ``--out`` accepts) and atomic file writes;
- ``unwritable``: the one-line error for a run-directory file that cannot be written.
- ``lock``: the lock a run holds on its run directory (host, pid; stale ones taken over).
- ``endings``: ``failure.json``, the record of how a run ended when it did not finish.
- ``metrics``: ``metrics.csv``, ``curves.png``, number formatting.
- ``plot_runs``: several runs' curves on one picture (``scaleloop plot``).
- ``trackers``: where metrics go besides ``metrics.csv`` (``--tracker``): TensorBoard, W&B, MLflow.
- ``footprint``: parameter, gradient and optimizer-state bytes per rank (``memory.json``).
- ``profile_trace``: one rank's profiled steps read from its trace (the parts of a step,
  communication exposed and overlapped, top operators).
- ``profile_summary``: ``profile/summary.json``, the slowest rank and why, the printed table.
- ``profile_plot``: ``profile/timeline.png``, the ranks' profiled steps by part.
"""
