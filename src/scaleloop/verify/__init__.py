"""``scaleloop verify``: prove that N processes train the same model as one, and show how.

Modules, one job each (torch is imported only by the ones that train or compare):

- ``__main__``  ``python -m scaleloop.verify``; the flags are ``scaleloop.commands.verify``'s
- ``options``   what was asked (steps, checks, step to explain, user loss), passed to workers
- ``command``   the whole run: reference, workers, checks, report
- ``steps``     the K training steps, shared by the reference and every worker
- ``recorder``  what each rank records; rank 0 writes it down
- ``worker``    the program torchrun starts on each rank; ``launch`` starts torchrun
- ``lockstep``  the run saves its state at every step; one process takes each step from it
- ``compare``   step-by-step differences and precision-aware tolerances; ``report`` prints them
- ``probes``    experiments on the model and loss; ``diagnose`` names the cause from them
- ``data``      per-batch SHA-256, per-epoch coverage, DistributedSampler padding
- ``sync``      a hash of every parameter and buffer on every rank
- ``buffers``   which saved tensors are buffers (a tied weight counted once, as a parameter)
- ``saved``     the step-0 check of every rank's model as built, and the end-of-run check of the saved state
- ``explain``   one step, rank by rank; ``plot``: the picture of the comparison (``--plot``)
- ``hashing``, ``dirs``: digests, where files go (the loss is ``loop.losses.resolve_loss``)

For your own loop, ``scaleloop.verify.data.coverage`` and ``distributed_sampler_coverage``
audit any sampler's index lists, and ``scaleloop.verify.sync.check_sync`` compares replicas.
"""
from __future__ import annotations
