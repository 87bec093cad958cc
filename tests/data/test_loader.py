"""Tests for scaleloop.data.loader: the in-memory fast path and the DataLoader path agree."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from scaleloop.data.loader import Batch, ShardedLoader, tensors_of
from scaleloop.data.sampler import StepSampler

CPU = torch.device("cpu")


class PlainDataset(Dataset):
    """A map-style dataset that is not a TensorDataset: read one sample at a time."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.calls = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.calls += 1
        return self.x[i], self.y[i]


class Doubled(TensorDataset):
    """A TensorDataset subclass whose __getitem__ transforms the sample (like augmentation)."""

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return x * 2, y


def _data(n: int = 37) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, generator=g), torch.randint(0, 5, (n,), generator=g)


def _collect(loader: ShardedLoader) -> list[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    return [(x, y, b.indices.tolist()) for b in loader for x, y in [b]]


@pytest.mark.parametrize("world,rank,acc", [(1, 0, 1), (1, 0, 3), (2, 1, 2), (3, 2, 1)])
def test_fast_path_and_dataloader_path_agree(world: int, rank: int, acc: int) -> None:
    x, y = _data()
    sampler = StepSampler(len(x), 12, world_size=world, rank=rank, accumulate=acc, seed=4)
    fast = ShardedLoader(TensorDataset(x, y), sampler, CPU)
    slow_ds = PlainDataset(x, y)
    slow = ShardedLoader(slow_ds, sampler, CPU)
    assert fast.in_memory is True
    assert slow.in_memory is False
    for epoch in (0, 1):
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        a, b = _collect(fast), _collect(slow)
        assert len(a) == len(b) > 0
        for (xa, ya, ia), (xb, yb, ib) in zip(a, b):
            assert ia == ib
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            assert torch.equal(xa, x[ia]) and torch.equal(ya, y[ia])
    assert slow_ds.calls > 0  # the DataLoader path really read through __getitem__


def test_batch_unpacks_and_exposes_its_plan() -> None:
    x, y = _data(20)
    sampler = StepSampler(20, 8, accumulate=2, shuffle=False)
    batches = list(ShardedLoader(TensorDataset(x, y), sampler, CPU))
    first = batches[0]
    assert isinstance(first, Batch)
    bx, by = first
    assert torch.equal(bx, x[:4]) and torch.equal(by, y[:4])
    assert len(first) == 4
    assert first.step == 0 and first.last_micro is False and first.loss_scale == pytest.approx(0.5)
    assert first.indices.tolist() == [0, 1, 2, 3]
    assert batches[1].last_micro is True
    # the last step holds 4 samples (20 = 2 * 8 + 4): two micro-batches of 2, each half the step
    last = batches[-1]
    assert last.step == 2 and len(last) == 2 and last.place.step_samples == 4
    assert last.loss_scale == pytest.approx(0.5)
    assert sum(len(b) for b in batches) == 20


def test_set_epoch_changes_the_order() -> None:
    x, y = _data(40)
    loader = ShardedLoader(TensorDataset(x, y), StepSampler(40, 10, seed=1), CPU)
    loader.set_epoch(0)
    e0 = [b.indices.tolist() for b in loader]
    again = [b.indices.tolist() for b in loader]
    loader.set_epoch(1)
    e1 = [b.indices.tolist() for b in loader]
    assert e0 == again
    assert e0 != e1
    assert sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(40))


def test_set_epoch_with_start_step_resumes() -> None:
    x, y = _data(40)
    loader = ShardedLoader(TensorDataset(x, y), StepSampler(40, 8, accumulate=2, seed=1), CPU)
    loader.set_epoch(2)
    full = [b.indices.tolist() for b in loader]
    loader.set_epoch(2, start_step=3)
    resumed = list(loader)
    assert resumed[0].step == 3
    assert [b.indices.tolist() for b in resumed] == full[6:]
    assert len(loader) == len(resumed) == 4


@pytest.mark.parametrize("n,batch,world,acc,drop", [(37, 12, 1, 1, False), (37, 12, 2, 2, False),
                                                    (37, 12, 3, 2, False), (37, 12, 1, 1, True),
                                                    (36, 12, 2, 3, False)])
def test_len_matches_batches_yielded(n: int, batch: int, world: int, acc: int, drop: bool) -> None:
    x, y = _data(n)
    for rank in range(world):
        sampler = StepSampler(n, batch, world_size=world, rank=rank, accumulate=acc, drop_last=drop)
        for ds in (TensorDataset(x, y), PlainDataset(x, y)):
            loader = ShardedLoader(ds, sampler, CPU)
            assert len(loader) == len(list(loader)) == sampler.steps_per_epoch * acc


def test_tensordataset_subclass_with_its_own_getitem_is_read_through_it() -> None:
    x, y = _data(10)
    loader = ShardedLoader(Doubled(x, y), StepSampler(10, 5, shuffle=False), CPU)
    assert loader.in_memory is False
    bx, _ = next(iter(loader))
    assert torch.equal(bx, x[:5] * 2)


def test_tensors_of() -> None:
    x, y = _data(5)
    assert tensors_of(TensorDataset(x, y)) is not None
    assert tensors_of(TensorDataset(x)) is None  # not an (x, y) pair
    assert tensors_of(PlainDataset(x, y)) is None


# --- the in-memory fast path and its options ---------------------------------------------

class TutorialDataset(Dataset):
    """The tutorial's RandomDataset as it writes it: tensors, read one sample at a time."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.X, self.y = x, y

    def __len__(self) -> int:
        return self.X.shape[0]

    def __getitem__(self, idx: int):
        return self.X[idx], self.y[idx]


@pytest.mark.parametrize("world,acc", [(1, 1), (2, 1), (2, 2), (3, 1)])
def test_fast_path_gives_the_per_item_batches_of_the_tutorial_dataset(world: int, acc: int) -> None:
    """The fast path (index_select on the built-in RandomDataset's tensors) and the per-item
    DataLoader path (the tutorial's own Dataset class) yield the very same batches: the same
    indices, the same tensors, for every rank, epoch and a resumed start."""
    from scaleloop.data.datasets import RandomDataset

    fast_ds = RandomDataset(203, input_dim=20, generator=torch.Generator().manual_seed(0))
    slow_ds = TutorialDataset(fast_ds.X, fast_ds.y)
    for rank in range(world):
        sampler = StepSampler(len(fast_ds), 24, world_size=world, rank=rank, accumulate=acc, seed=7)
        fast, slow = ShardedLoader(fast_ds, sampler, CPU), ShardedLoader(slow_ds, sampler, CPU)
        assert fast.in_memory and not slow.in_memory
        for epoch, start in ((0, 0), (1, 0), (3, 2)):
            fast.set_epoch(epoch, start)
            slow.set_epoch(epoch, start)
            a, b = _collect(fast), _collect(slow)
            assert len(a) == len(b) == len(fast) > 0
            for (xa, ya, ia), (xb, yb, ib) in zip(a, b):
                assert ia == ib
                assert xa.dtype == xb.dtype and ya.dtype == yb.dtype
                assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_fast_path_draws_the_permutation_of_a_seeded_dataloader_shuffle() -> None:
    """Same per-epoch permutation as DataLoader(shuffle=True)'s RandomSampler with a generator
    seeded with seed + epoch: one process sees the batches the tutorial's loop sees."""
    from torch.utils.data import DataLoader, RandomSampler

    x, y = _data(50)
    ds = TensorDataset(x, y)
    g = torch.Generator()
    tutorial = DataLoader(ds, batch_size=16, sampler=RandomSampler(ds, generator=g))
    loader = ShardedLoader(ds, StepSampler(50, 16, seed=3), CPU)
    for epoch in (0, 1, 2):
        g.manual_seed(3 + epoch)
        loader.set_epoch(epoch)
        for (xa, ya), (xb, yb) in zip(tutorial, loader, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_options_leave_the_batches_unchanged() -> None:
    x = torch.randn(30, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (30,), generator=torch.Generator().manual_seed(2))
    sampler = StepSampler(30, 8, seed=2)
    plain = _collect(ShardedLoader(TensorDataset(x, y), sampler, CPU))
    fast = ShardedLoader(TensorDataset(x, y), sampler, CPU, on_device=True, channels_last=True, pin_memory=True)
    assert fast.pin_memory is False          # pinning is for CUDA copies only
    for (xa, ya, ia), (xb, yb, ib) in zip(plain, _collect(fast), strict=True):
        assert ia == ib and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xb.is_contiguous(memory_format=torch.channels_last)
    slow = ShardedLoader(PlainDataset(x, y), sampler, CPU, channels_last=True)
    for (xa, _, _), (xb, _, _) in zip(plain, _collect(slow), strict=True):
        assert torch.equal(xa, xb) and xb.is_contiguous(memory_format=torch.channels_last)


def test_persistent_workers_give_every_epoch_its_own_order() -> None:
    x, y = _data(24)
    sampler = StepSampler(24, 8, seed=5)
    once = ShardedLoader(PlainDataset(x, y), sampler, CPU, num_workers=1)
    kept = ShardedLoader(PlainDataset(x, y), sampler, CPU, num_workers=1, persistent_workers=True)
    for epoch in (0, 1, 2):
        once.set_epoch(epoch)
        kept.set_epoch(epoch)
        a, b = _collect(once), _collect(kept)
        assert [i for _, _, i in a] == [i for _, _, i in b]
        assert all(torch.equal(xa, xb) for (xa, _, _), (xb, _, _) in zip(a, b))
    assert kept._loader is not None         # one DataLoader, its workers kept between epochs


def test_options_this_dataset_cannot_use_are_refused() -> None:
    x, y = _data(10)
    with pytest.raises(ValueError, match="in-memory tensors"):
        ShardedLoader(PlainDataset(x, y), StepSampler(10, 5), CPU, on_device=True)
    with pytest.raises(ValueError, match="num_workers > 0"):
        ShardedLoader(PlainDataset(x, y), StepSampler(10, 5), CPU, persistent_workers=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_pinned_and_on_device_batches_equal_the_cpu_ones() -> None:
    x, y = _data(100)
    sampler = StepSampler(100, 16, seed=1)
    cuda = torch.device("cuda")
    ref = _collect(ShardedLoader(TensorDataset(x, y), sampler, CPU))
    for options in (dict(pin_memory=True), dict(pin_memory=False), dict(on_device=True)):
        loader = ShardedLoader(TensorDataset(x, y), sampler, cuda, **options)
        got = _collect(loader)
        torch.cuda.synchronize()
        for (xa, ya, ia), (xb, yb, ib) in zip(ref, got, strict=True):
            assert ia == ib and xb.device.type == "cuda"
            assert torch.equal(xa, xb.cpu()) and torch.equal(ya, yb.cpu())


@pytest.mark.parametrize("load", [(True, False), (False, True), (False, False)])
def test_a_rank_loads_only_the_parts_it_uses(load: tuple[bool, bool]) -> None:
    """A pipeline's first stage loads the inputs, its last the targets, a middle one neither:
    the part left out is None on both paths, the rest and the sample counts as with both."""
    x, y = _data()
    sampler = StepSampler(len(x), 12, world_size=1, rank=0, accumulate=2, seed=4)
    whole = _collect(ShardedLoader(TensorDataset(x, y), sampler, CPU))
    for dataset in (TensorDataset(x, y), PlainDataset(x, y)):
        batches = list(ShardedLoader(dataset, sampler, CPU, load=load))
        assert [len(b) for b in batches] == [len(i) for _, _, i in whole]
        for batch, (xw, yw, _) in zip(batches, whole):
            got_x, got_y = batch
            assert (got_x is not None, got_y is not None) == load
            assert got_x is None or torch.equal(got_x, xw)
            assert got_y is None or torch.equal(got_y, yw)


def test_a_part_that_is_not_a_tensor_is_kept_so_every_rank_sees_the_batch_shape() -> None:
    # A mapping of inputs is not left out: every pipeline stage then refuses it with the same line.
    class Named(Dataset):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int):
            return {"a": torch.tensor([float(i)])}, torch.tensor(i)

    sampler = StepSampler(8, 4, world_size=1, rank=0, accumulate=1, seed=0, shuffle=False)
    x, y = next(iter(ShardedLoader(Named(), sampler, CPU, load=(False, False))))
    assert isinstance(x, dict) and y is None


class _RaisesAt(PlainDataset):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == 5:
            raise KeyError(f"no record {i}")
        return super().__getitem__(i)


class _ReadsBatches(_RaisesAt):
    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self[i] for i in indices]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) are Python 3.11's")
@pytest.mark.parametrize("dataset, note", [(_RaisesAt, "scaleloop: while reading sample 5"),
                                           (_ReadsBatches, "scaleloop: while reading sample 0 or one of the 9 after it")])
def test_a_sample_that_raises_is_named_on_the_error_and_in_the_runs_report(dataset: type, note: str) -> None:
    from scaleloop.launching.worker import describe_exception

    x, y = _data()
    loader = ShardedLoader(dataset(x[:10], y[:10]), StepSampler(10, 10, shuffle=False), CPU)
    with pytest.raises(KeyError) as caught:
        list(loader)
    assert caught.value.__notes__ == [note]   # the user's own exception, its type and message kept
    if dataset is _RaisesAt:
        assert describe_exception(caught.value, 0)["message"] == "'no record 5' (reading sample 5)"


def test_worker_processes_refuse_a_temporary_directory_too_long_for_their_sockets(monkeypatch: pytest.MonkeyPatch,
                                                                                   tmp_path: Path) -> None:
    # Past 75 characters, the socket a worker process hands its batch through no longer binds
    # (AF_UNIX: 107), the worker's sending thread fails unreported, and the run waits forever.
    from scaleloop.data.loader import check_worker_socket_dir
    from scaleloop.errors import UsageError

    fits = tmp_path / ("f" * (75 - len(str(tmp_path)) - 1))
    monkeypatch.setattr(tempfile, "tempdir", str(fits))
    assert len(str(fits)) == 75
    check_worker_socket_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(fits) + "x")
    with pytest.raises(UsageError, match=r"\(76 characters; at most 75 fit\): set TMPDIR to a shorter path"):
        check_worker_socket_dir()
