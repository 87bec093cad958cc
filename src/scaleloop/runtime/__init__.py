"""Launching and the process environment: who this process is, and how workers start.

- ``dist``: ``DistEnv`` (rank, world size, device, backend; the one reader of the launcher's
  variables) and the process group's start and end.
- ``collectives``: sums, gathers and broadcasts over ranks as plain functions of a ``DistEnv``,
  and the exact, padding-free helpers for user metrics (``gather_tensor``, ``shard_indices``).
- ``devices``: the best device and a local rank's device.
- ``torchrun``: ``scaleloop train --nproc/--nnodes`` re-launched under ``torch.distributed.run``.
- ``rendezvous``: a multi-machine job's c10d rendezvous: this machine's address, and whether it hosts.
- ``spawn``: ``scaleloop.launch(fn, nproc=N)`` from a script or a notebook.
- ``slurm``: ranks and the master address from SLURM's variables; ``scontrol requeue``.
- ``preempt``: stop signals (SIGTERM, SIGUSR1, ``--signal``) noted, not fatal; the one line after the stop.
- ``envinfo``: ``scaleloop env``.
- ``launcher``: ``scaleloop train`` behind its flags: train here, or start the workers under torchrun.
- ``cmdline``: the command line's shared parts (one-line-error parser, config flags, exit codes).
- ``agent``: torchrun as the launcher runs it, its own messages in ``logs/torchrun.log``.
- ``worker``: each worker's entry: its log, torchrun's ``record`` with scaleloop's extras, stack dumps.
- ``failures``: after a failure, which rank failed first or stalled, and where; the report and
  ``failure.json``.
- ``frames``: which frames are the user's; where the loop was when an exception left it.
- ``recovery``: an elastic job's recovery from a fault, timed from what each attempt leaves behind.
"""
