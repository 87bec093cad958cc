"""``scaleloop bench``: measure what scaling a training loop costs and gains, and say so in tables.

One module per job:

- ``hardware``   names the machine a result was measured on (for file names and reports)
- ``report``     one result as JSON + markdown table + PNG, in dated files
- ``stats``      medians and spreads of repeated measurements
- ``workload``   the benchmarked training (model, data, batch), built the same way everywhere
- ``worker``     the instrumented step loop; run under torchrun for N workers
- ``launcher``   starts workers (torchrun for N > 1) and reads back their JSON
- ``costmodel``  the ring all-reduce cost model and the projection to large clusters
- ``published``  that model against a published scaling table, with its error
- ``breakdown``  why N workers are not N x one: data, compute, communication and idle time per step
- ``flops``      FLOPs per sample (``torch.utils.flop_counter``), peak FLOP/s, MFU
- ``rawloop``    the hand-written PyTorch loop that the overhead bench compares against
- ``loopcost``   the loop's own cost per step, piece by piece (batch objects, step calls, loss sums, logging)
- ``devices``, ``scaling``, ``strategies``, ``overhead``, ``mfu``: the bench commands
- ``plots``      the PNG charts (matplotlib, imported lazily)
- ``index``      a results directory's README.md, current results and those in history/ (``scaleloop bench index``)
- ``startup``    what ``import scaleloop`` and ``scaleloop --help`` cost (``overhead --mode startup``)
- ``__main__``   ``python -m scaleloop.bench``; the flags are ``scaleloop.commands.bench``'s
"""
