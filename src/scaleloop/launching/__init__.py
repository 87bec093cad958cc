"""Starting workers and reading how they ended: the floor between the commands and the trainer.

- ``launcher``: ``scaleloop train`` behind its flags: train here, or start the workers under torchrun.
- ``preflight``: the checks done once before N workers start, without torch for the common settings.
- ``torchrun``: the workers' launch as settings (``WorkerLaunch``), and the torchrun commands made from them.
- ``supervisor``: the one way train, verify and bench start workers: torchrun watched, stop signals
  passed on, the exit code and the failure report.
- ``lifeline``: a started process ends with the process that started it (Linux), even on ``kill -9``.
- ``agent``: torchrun as the launcher runs it, its own messages in ``logs/torchrun.log``; its
  workers are fresh interpreters, as under plain torchrun.
- ``worker``: each worker's entry: its log, torchrun's ``record`` with scaleloop's extras, stack dumps.
- ``console``: a run's prints go nowhere once their reader has gone (``| head``); it trains on.
- ``spawn``: ``scaleloop.launch(fn, nproc=N)`` from a script or a notebook.
- ``forks``: ``scaleloop.launch``'s forks (its agent a fork of the caller; a forked worker waits
  until the agent has forked the others). Train, verify and bench fork nothing.
- ``rendezvous``: a multi-machine job's c10d rendezvous: this machine's address, and whether it hosts.
- ``jobs``: ``scaleloop train`` in the job that started it: a Kubeflow pod as one machine of the job;
  leftover ``RANK``/``WORLD_SIZE`` refused or ignored in one line.
- ``srun``: ``scaleloop train`` as an ``srun`` task: its first line says what it read, and its wait
  for the other tasks ends in one line (who never came and what to do, or the signal that stopped it).
- ``replica_groups``: ``--replica-groups N`` on one machine: the lighthouse and N group launchers,
  their output prefixed ``[group I]``. ``lighthouse``: torchft's lighthouse and its start gate
  (``python -m scaleloop.launching.lighthouse`` across machines).
- ``failures``: after a failure, which rank failed first or stalled, and where; the report and
  ``failure.json``.
"""
