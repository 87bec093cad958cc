"""Starting workers and reading how they ended: the floor between the commands and the trainer.

- ``launcher``: ``scaleloop train`` behind its flags: train here, or start the workers under torchrun.
- ``torchrun``: ``scaleloop train --nproc/--nnodes`` re-launched under ``torch.distributed.run``.
- ``agent``: torchrun as the launcher runs it, its own messages in ``logs/torchrun.log``.
- ``worker``: each worker's entry: its log, torchrun's ``record`` with scaleloop's extras, stack dumps.
- ``spawn``: ``scaleloop.launch(fn, nproc=N)`` from a script or a notebook.
- ``rendezvous``: a multi-machine job's c10d rendezvous: this machine's address, and whether it hosts.
- ``failures``: after a failure, which rank failed first or stalled, and where; the report and
  ``failure.json``.
"""
