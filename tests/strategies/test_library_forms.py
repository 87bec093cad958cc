"""The library forms users know, in one process (issue 52, point 6: never train silently wrong).

- ``strategy.setup(model, optimizer_object)``: the object's groups and hyper-parameters are moved
  onto the parameters the strategy made (FSDP2 swaps them for DTensors), so it trains bit for bit as
  the factory form does; the same object comes back (an LR scheduler made before still drives it);
  what cannot be moved (state, foreign tensors, references kept outside the groups) is refused in
  one line naming the factory form.
- ``strategy.loader(DataLoader(...))``: its dataset, batch size (the GLOBAL batch), shuffling,
  drop_last, collate_fn, num_workers; what it cannot honour is refused in one line.

The same on 2 processes under every strategy: tests/distributed/test_library_forms_dist.py.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, RandomSampler, SubsetRandomSampler,
                              TensorDataset, WeightedRandomSampler, default_collate)

import scaleloop as sl
from scaleloop.data.streaming import StreamingLoader
from scaleloop.errors import UsageError

CPU = sl.DistEnv()


@pytest.fixture(autouse=True)
def no_group_left() -> Iterator[None]:
    yield
    if torch_dist.is_initialized():  # fsdp on one process starts a group of its own
        torch_dist.destroy_process_group()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 1))


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).tanh())


def two_groups(params: Any) -> list[dict[str, Any]]:
    """Hyper-parameters of each group's own, by shape, so the factory (given the strategy's
    parameters) builds the same groups as the object built on the user's model."""
    params = list(params)
    return [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() == 1], "lr": 0.1, "momentum": 0.0}]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(two_groups(params), lr=0.05, momentum=0.9)


def train(name: str, optimizer: Callable[[nn.Module], Any], env: sl.DistEnv = CPU, steps: int = 8
          ) -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer, Any]:
    """Train ``net()`` under strategy ``name``; ``optimizer(model)`` is what ``setup`` gets.
    Returns the full weights, the optimizer setup returned and the object or factory it got."""
    model = net()
    strategy = sl.strategy(name, env)
    given = optimizer(model)
    model, opt = strategy.setup(model, given)
    loader = strategy.loader(data(), 16, seed=0)
    done = 0
    while done < steps:
        loader.set_epoch(done)
        for batch in loader:
            strategy.forward_backward(model, batch, F.mse_loss)
            if batch.last_micro:
                strategy.optimizer_step(opt)
                done += 1
    state = {k: v.detach().cpu().clone() for k, v in strategy.full_state_dict(model).items()}
    strategy.close()
    return state, opt, given


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: largest difference {(a[k] - b[k]).abs().max():.2e}"


def moved(state: dict[str, torch.Tensor]) -> float:
    start = net().state_dict()
    return max(float((state[k] - start[k]).abs().max()) for k in state)


# --- setup(model, optimizer_object) ----------------------------------------------------------
@pytest.mark.parametrize("name", ["single", "fsdp", "allreduce", "ddp",
                                  pytest.param("dp", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="nn.DataParallel needs CUDA"))])
def test_an_optimizer_object_trains_as_the_factory(name: str) -> None:
    env = sl.DistEnv(device=torch.device("cuda")) if name == "dp" else CPU
    by_factory, _, _ = train(name, lambda model: sgd, env)
    by_object, opt, given = train(name, lambda model: sgd(model.parameters()), env)
    assert moved(by_factory) > 0.05   # it trained
    assert_bitwise(by_object, by_factory)
    assert opt is given   # the user's object, re-pointed: what they hold (and a scheduler) drives it
    assert [(g["lr"], g["momentum"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [
        (0.05, 0.9, 0.01, 3), (0.1, 0.0, 0, 3)]


def test_under_fsdp_the_groups_hold_the_sharded_parameters_and_a_scheduler_still_drives_them() -> None:
    # Before the fix the object kept the plain tensors FSDP2 had replaced: 16 steps moved nothing.
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)   # made before setup
    strategy = sl.strategy("fsdp", CPU)
    model, same = strategy.setup(model, opt)
    assert same is opt
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.025
    strategy.close()


def test_names_and_a_kept_params_list_follow_the_parameters() -> None:
    # An optimizer built on named_parameters() keeps the names beside the parameters; LBFGS keeps
    # its group's list itself (_params): both must see the parameters FSDP made.
    model = net()
    named = torch.optim.SGD(model.named_parameters(), lr=0.05)
    names = list(named.param_groups[0]["param_names"])
    strategy = sl.strategy("fsdp", CPU)
    wrapped, _ = strategy.setup(model, named)
    made = list(wrapped.parameters())
    assert named.param_groups[0]["param_names"] == names
    assert [id(p) for p in named.param_groups[0]["params"]] == [id(p) for p in made]
    strategy.close()

    model = net()
    lbfgs = torch.optim.LBFGS(model.parameters())
    strategy = sl.strategy("fsdp", CPU)
    wrapped, _ = strategy.setup(model, lbfgs)
    assert lbfgs._params is lbfgs.param_groups[0]["params"]
    assert [id(p) for p in lbfgs._params] == [id(p) for p in wrapped.parameters()]
    strategy.close()


class KeepsItsOwn(torch.optim.SGD):
    """An optimizer that keeps its parameters outside its groups (as ZeroRedundancyOptimizer does)."""

    def __init__(self, params: Any, **kw: Any) -> None:
        params = list(params)
        super().__init__(params, **kw)
        self.all_params = list(params)


def stepped(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 6)).sum().backward()
    opt.step()
    return opt


@pytest.mark.parametrize("make, says", [
    (stepped, "Adam that already holds state for 6 parameter(s)"),
    (lambda model: torch.optim.Adagrad(model.parameters()), "Adagrad that already holds state"),
    (lambda model: torch.optim.SGD(list(model.parameters()) + [nn.Parameter(torch.zeros(2, 5))], lr=0.1),
     "holding 1 tensor(s) that are not parameters of the model (shapes (2, 5))"),
    (lambda model: KeepsItsOwn(model.parameters(), lr=0.1), "keeps its own references to its parameters (in all_params)"),
])
@pytest.mark.parametrize("name", ["single", "fsdp"])
def test_an_optimizer_that_cannot_be_moved_is_refused_in_one_line(name: str, make: Callable, says: str) -> None:
    model = net()
    opt = make(model)
    strategy = sl.strategy(name, CPU)
    with pytest.raises(UsageError) as err:
        strategy.setup(model, opt)
    message = str(err.value)
    assert says in message and "strategy.setup(model, lambda params: " in message, message
    assert "\n" not in message
    assert not torch_dist.is_initialized()   # refused before anything was done


# --- loader(DataLoader) ----------------------------------------------------------------------
def batches(loader: Any, epochs: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [(x, y) for x, y in loader]
    return out


def assert_same_batches(a: list, b: list) -> None:
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("shuffle, drop_last, n", [(True, False, 64), (False, False, 64), (True, True, 70),
                                                   (False, False, 70)])
def test_a_dataloader_gives_its_dataset_global_batch_shuffle_and_drop_last(shuffle: bool, drop_last: bool,
                                                                           n: int) -> None:
    # accumulate=2: the DataLoader's batch_size is the GLOBAL batch, cut into micro-batches of 8.
    strategy = sl.strategy("single", CPU, accumulate=2)
    ds = data(n)
    given = strategy.loader(DataLoader(ds, batch_size=16, shuffle=shuffle, drop_last=drop_last), seed=3)
    plain = strategy.loader(ds, 16, shuffle=shuffle, drop_last=drop_last, seed=3)
    assert given.sampler.global_batch == 16 and given.sampler.accumulate == 2
    assert {len(x) for x, _ in batches(given)} == ({8} if drop_last or n % 16 == 0 else {8, 3})
    assert_same_batches(batches(given), batches(plain))


def test_a_dataloaders_collate_fn_and_workers_are_used() -> None:
    # On in-memory tensors the loader gathers batches without collating; a collate function of
    # the user's own must still see every batch (here: inputs doubled).
    def doubled(samples: list) -> Any:
        x, y = default_collate(samples)
        return 2 * x, y

    strategy = sl.strategy("single", CPU)
    ds = data()
    given = strategy.loader(DataLoader(ds, batch_size=16, shuffle=True, collate_fn=doubled), seed=0)
    plain = strategy.loader(ds, 16, seed=0)
    assert_same_batches(batches(given), [(2 * x, y) for x, y in batches(plain)])
    workers = strategy.loader(DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True))
    assert (workers.num_workers, workers.persistent_workers) == (2, True)


class Stream(IterableDataset):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(40):
            yield torch.full((6,), float(i)), torch.zeros(1)


def test_a_dataloader_of_a_stream_gives_the_stream() -> None:
    loader = sl.strategy("single", CPU).loader(DataLoader(Stream(), batch_size=8))
    assert isinstance(loader, StreamingLoader)
    assert [x[:, 0].tolist() for x, _ in loader][:2] == [list(map(float, range(8))), list(map(float, range(8, 16)))]


class OwnIteration(DataLoader):
    def __iter__(self) -> Any:
        return (batch for batch in super().__iter__())


@pytest.mark.parametrize("make, says", [
    (lambda ds: DataLoader(ds, sampler=WeightedRandomSampler([1.0] * len(ds), len(ds)), batch_size=16),
     "cannot honour the DataLoader's WeightedRandomSampler"),
    (lambda ds: DataLoader(ds, sampler=SubsetRandomSampler(range(10)), batch_size=16), "torch.utils.data.Subset"),
    (lambda ds: DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=0), batch_size=16),
     "the strategy splits each global batch over the ranks itself: drop it"),
    (lambda ds: DataLoader(ds, sampler=RandomSampler(ds, replacement=True), batch_size=16), "RandomSampler"),
    (lambda ds: DataLoader(ds, batch_sampler=[[0, 1], [2, 3]]), "has none (a batch_sampler of its own"),
    (lambda ds: DataLoader(ds, batch_size=16, worker_init_fn=print), "worker_init_fn"),
    (lambda ds: OwnIteration(ds, batch_size=16), "cannot use OwnIteration: it iterates its own way"),
])
def test_a_dataloader_it_cannot_honour_is_refused_in_one_line(make: Callable, says: str) -> None:
    with pytest.raises(UsageError) as err:
        sl.strategy("single", CPU).loader(make(data()))
    assert says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_keywords_that_contradict_the_dataloader_and_a_dataset_without_batch_size_are_refused() -> None:
    strategy = sl.strategy("single", CPU)
    with pytest.raises(UsageError, match=r"DataLoader with batch_size=16 and batch_size=32"):
        strategy.loader(DataLoader(data(), batch_size=16), 32)
    with pytest.raises(UsageError, match=r"DataLoader with shuffle=False and shuffle=True"):
        strategy.loader(DataLoader(data(), batch_size=16), shuffle=True)
    with pytest.raises(UsageError, match=r"needs the global batch_size"):
        strategy.loader(data())
    assert strategy.loader(DataLoader(data(), batch_size=16), 16, shuffle=False).sampler.global_batch == 16


def test_a_loop_written_with_the_old_name_accumulate_trains_the_same_and_is_told_the_new_one() -> None:
    """``strategy.accumulate(model, batch)`` was the micro-step's context; it is ``micro_step`` now
    (``accumulate`` is the number of micro-steps). A loop written with the old name still runs, the
    same bit for bit, and hears the new name (issue 54: one meaning per name)."""
    def hand_written(old_name: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = net()
        strategy = sl.strategy("single", CPU, accumulate=2)
        model, opt = strategy.setup(model, lambda params: torch.optim.SGD(params, lr=0.05))
        context = strategy.accumulate if old_name else strategy.micro_step
        for batch in strategy.loader(data(), 16, seed=0):
            x, y = batch
            with context(model, batch):
                with strategy.autocast():
                    loss = F.mse_loss(model(x), y)
                strategy.backward(loss, batch)
            if batch.last_micro:
                strategy.optimizer_step(opt)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    new = hand_written(old_name=False)
    with pytest.warns(FutureWarning, match=r"strategy\.micro_step\(model, batch\)"):
        old = hand_written(old_name=True)
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)
