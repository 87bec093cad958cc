"""The ground floor: this process and its peers. Who this process is, on which device, with whom.

Nothing here starts a process or reads the config; every floor above may use it.

- ``dist``: ``DistEnv`` (rank, world size, device, backend; the one reader of the launcher's
  variables) and the process group's start and end.
- ``started``: who started this process (torchrun, ``srun``, the user), from the environment alone.
- ``cluster``: which job this process is in (torchrun, ``srun``, a Kubeflow pod, leftover variables).
- ``slurm``: ranks and the master address from SLURM's variables; ``scontrol requeue``.
- ``srun_rendezvous``: ``srun`` tasks meet at rank 0's store within a time limit, heard by signals.
- ``kubeflow``: a pod's place in its PyTorchJob or TrainJob, from the operator's variables.
- ``devices``: the best device and a local rank's device; the datasheet peak FLOP/s of known GPUs.
- ``collectives``: sums, gathers and broadcasts over ranks as plain functions of a ``DistEnv``,
  and the exact, padding-free helpers for user metrics (``gather_tensor``, ``shard_indices``).
- ``mesh``: ``MeshSpec``, the ranks laid out on named dimensions (pp, dp, fsdp, tp).
- ``preempt``: stop signals (SIGTERM, SIGUSR1, ``--signal``) noted, not fatal; the one line after the stop.
- ``frames``: which frames are the user's; where the loop was when an exception left it.
- ``recovery``: an elastic job's recovery from a fault, timed from what each attempt leaves behind.
- ``exiting``: a process's end, without the interpreter's last garbage collection over torch's objects.
- ``collector``: the garbage collector paused while torch is imported and a run is built.
- ``startwatch``: a slow start-up step (reading the data, building the model, ...) says which it is
  and where it runs.
"""
