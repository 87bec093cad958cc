"""Under torchrun with 2 processes: the library forms users know, under every strategy, in one launch.

Each cell trains its own model (same seed) through the library API, as a hand-written loop does:
``strategy.setup(model, optimizer)`` with an optimizer OBJECT built on the user's model, or with a
``params -> optimizer`` factory, and ``strategy.loader`` with a dataset and a global batch size or
with a ``torch.utils.data.DataLoader``. Usage: library_forms.py OUT; rank 0 saves to OUT
(``torch.save``) ``{"weights": {cell: full state dict}, "holds": {cell: [per rank: whether the
optimizer holds exactly the parameters the rank trains]}}``. tests/distributed/test_library_forms_dist.py
imports :func:`train_cell` from here for the 1-process references.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import scaleloop as sl
from scaleloop.runtime.collectives import gather_object

STEPS_PER_EPOCH, EPOCHS, BATCH = 4, 4, 16      # 16 optimizer steps of a global batch of 16
GroupSpec = list[dict[str, Any]]


class Net(nn.Sequential):
    """An MLP every strategy runs: a Sequential (pipeline stages), with a TP plan (``--mesh tp=2``)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def tp_plan(self, tp: int) -> dict[str, str]:
        return {"0": "colwise", "2": "rowwise"}


def dataset() -> sl.RandomDataset:
    return sl.RandomDataset(STEPS_PER_EPOCH * BATCH, input_dim=8, generator=torch.Generator().manual_seed(1))


def doubled(samples: list) -> Any:
    """A collate function of the user's own: inputs doubled (so a loader that skipped it would differ)."""
    x, y = torch.utils.data.default_collate(samples)
    return 2 * x, y


def groups(params: Iterable[torch.Tensor], two: bool) -> Union[GroupSpec, list[torch.Tensor]]:
    """Two groups with their own hyper-parameters (weights: decay; biases: higher lr, no momentum),
    chosen by shape so that the factory (which sees the strategy's parameters) makes the same; or one."""
    params = list(params)
    if not two:
        return params
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() == 1], "lr": 0.1, "momentum": 0.0}]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_cell(name: str, env: sl.DistEnv, *, form: str = "object", data: str = "dataset", two_groups: bool = True,
               **options: Any) -> tuple[dict[str, torch.Tensor], bool]:
    """Train one cell; the full weights on rank 0 (``{}`` elsewhere), and whether the optimizer
    holds exactly the parameters this rank trains (its pipeline stage's, FSDP's DTensors).

    ``form``: ``object`` (an optimizer built on the user's model before ``setup``) or ``factory``;
    ``data``: ``dataset`` (dataset and global batch size) or ``dataloader`` (a DataLoader with a
    collate function of its own; the reference for it is also a DataLoader)."""
    torch.manual_seed(0)
    model = Net()
    strategy = sl.strategy(name, env, **options)
    optimizer: Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]
    if form == "object":
        optimizer = sgd(groups(model.parameters(), two_groups))
    else:
        optimizer = lambda params: sgd(groups(params, two_groups))  # noqa: E731
    model, optimizer = strategy.setup(model, optimizer)
    holds = ({id(p) for group in optimizer.param_groups for p in group["params"]}
             == {id(p) for p in model.parameters()})
    if data == "dataloader":
        loader = strategy.loader(DataLoader(dataset(), batch_size=BATCH, shuffle=True, collate_fn=doubled))
    else:
        loader = strategy.loader(dataset(), BATCH, shuffle=True)
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            strategy.forward_backward(model, batch, F.mse_loss)
            if batch.last_micro:
                strategy.optimizer_step(optimizer)
    state = strategy.full_state_dict(model)
    strategy.close()
    return {k: v.detach().cpu().clone() for k, v in state.items()}, holds


#: cell -> (strategy, its options, whether the optimizer has two groups; the pipeline takes one)
STRATEGIES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "ddp": ("ddp", {}, True),
    "allreduce": ("allreduce", {}, True),
    "fsdp": ("fsdp", {}, True),
    "pipeline": ("pipeline", {}, False),
    "mesh-tp": ("mesh", {"mesh": "tp=2"}, True),
    "mesh-dp": ("mesh", {"mesh": "dp=2"}, True),
}
#: the DataLoader form: cell -> (strategy cell, accumulation)
DATALOADER = {"ddp/dataloader": ("ddp", 2), "fsdp/dataloader": ("fsdp", 1), "pipeline/dataloader": ("pipeline", 1)}


def main(out: str) -> None:
    env = sl.DistEnv.from_env(device="cpu")
    sl.init_process_group(env)
    weights: dict[str, dict[str, torch.Tensor]] = {}
    holds: dict[str, bool] = {}
    for cell, (name, options, two) in STRATEGIES.items():
        for form in ("object", "factory"):
            weights[f"{cell}/{form}"], holds[f"{cell}/{form}"] = train_cell(name, env, form=form, two_groups=two,
                                                                             **options)
    for cell, (base, accumulate) in DATALOADER.items():
        name, options, two = STRATEGIES[base]
        weights[cell], holds[cell] = train_cell(name, env, data="dataloader", two_groups=two, accumulate=accumulate,
                                                **options)
    every_rank = gather_object(holds, env)
    sl.destroy_process_group()
    if env.is_main:
        torch.save({"weights": weights, "holds": {cell: [h[cell] for h in every_rank] for cell in holds}}, out)


if __name__ == "__main__":
    main(sys.argv[1])
