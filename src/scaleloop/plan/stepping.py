"""A layout's TinyGPT built and stepped on the CPU: what ``--measure-host`` runs
(:mod:`scaleloop.plan.hostwork`), and the repository's check of the plan against measurement
(``tools/plan_validate``) too.

The model is ``spec``'s TinyGPT with Adam, set up by the strategy the layout's train flags name,
on random token windows; a step is the strategy's ``forward_backward`` and ``optimizer_step``, as
in ``scaleloop train``. :func:`fake_group` makes this process rank 0 of a larger layout on
PyTorch's fake process group, whose collectives end as they are issued.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelSpec


def _strategy(layout: Layout, env: Any) -> Any:
    from scaleloop.strategies.factory import build_strategy
    from scaleloop.strategies.registry import ParallelSettings

    flags = layout.train_flags(env.world_size, 1)
    mesh = flags[flags.index("--mesh") + 1] if "--mesh" in flags else None
    name = "mesh" if mesh else flags[flags.index("--strategy") + 1]
    return build_strategy(ParallelSettings(strategy=name, microbatches=layout.microbatches, mesh=mesh,
                                           pipeline_schedule="1f1b" if layout.pp > 1 else "gpipe",
                                           activation_checkpointing=layout.checkpointing, cpu_offload=layout.offload),
                          env)


def token_dataset(spec: ModelSpec, batch_size: int) -> Any:
    """Random token windows for a few steps (built before any profiler starts: not counted)."""
    import torch

    tokens = torch.randint(0, spec.vocab_size, (batch_size * 8, spec.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def build_run(spec: ModelSpec, layout: Layout, env: Any, dataset: Any, batch_size: int) -> tuple[Any, Any, Any, Any]:
    """``spec``'s TinyGPT set up by ``layout``'s strategy on ``env``, with Adam and a loader:
    (model, optimizer, strategy, loader), what :func:`run_steps` takes."""
    import torch

    from scaleloop.models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(spec.vocab_size, spec.seq_len, d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads)
    strategy = _strategy(layout, env)
    model, optimizer = strategy.setup(model, lambda params: torch.optim.Adam(params, lr=1e-3))
    return model, optimizer, strategy, strategy.loader(dataset, batch_size=batch_size, shuffle=False)


def lm_loss(logits: Any, target: Any) -> Any:
    """The language model's loss the measured steps train on: cross-entropy over every token."""
    import torch

    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def run_steps(model: Any, optimizer: Any, strategy: Any, loader: Any, steps: int) -> list[float]:
    """``steps`` optimizer steps; the time each one ended (perf_counter)."""
    ends = []
    batches = iter(loader)
    for _ in range(steps):
        batch = next(batches)
        strategy.forward_backward(model, batch, lm_loss)
        strategy.optimizer_step(optimizer)
        ends.append(time.perf_counter())
    return ends


@contextmanager
def fake_group(world: int) -> Iterator[Any]:
    """This process as rank 0 of ``world`` on PyTorch's fake process group (the default group
    while inside: run it in a process of its own); yields the ``DistEnv`` the strategies take."""
    import torch
    import torch.distributed as torch_dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scaleloop.runtime.dist import DistEnv

    ranks = {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world)}
    env = DistEnv.from_env(ranks, device="cpu", backend="fake")
    torch.set_num_threads(1)
    torch_dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield env
    finally:
        torch_dist.destroy_process_group()
