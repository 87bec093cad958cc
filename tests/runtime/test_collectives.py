"""scaleloop.runtime.collectives in one process: sharding, and the collectives over ranks simulated by threads.

``FakeDist`` stands in for ``torch.distributed`` (all_gather, all_gather_object, all_reduce)
for W threads of one process, so the multi-rank logic (padding to the longest rank, cutting
it off again, interleaving DistributedSampler results) is checked quickly here; the real Gloo
run is tests/distributed/test_eval_exact.py.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler, TensorDataset

import scaleloop.runtime.collectives as gather
from scaleloop.data.info import DataInfo
from scaleloop.runtime.dist import DistEnv
from scaleloop.loop.evaluation import evaluate
from scaleloop.runtime.collectives import gather_padded, gather_tensor, shard_indices, sum_over_ranks
from scaleloop.strategies.base import Strategy


def env_of(rank: int, world: int) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)


class FakeDist:
    """The few torch.distributed collectives gather.py uses, for ``world`` threads."""

    class ReduceOp:
        SUM = "sum"

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=10)
        self.slots: list[Any] = [None] * world
        self.local = threading.local()
        self.calls = 0

    def _exchange(self, value: Any) -> list[Any]:
        self.slots[self.local.rank] = value
        self.barrier.wait()
        values = list(self.slots)
        if self.local.rank == 0:
            # Counted before the second barrier so every rank reads the same count afterwards.
            self.calls += 1
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return values

    # What Gloo's all_gather refuses (torch 2.13): the fake refuses it too, as a real group would.
    REFUSED = (torch.int16, torch.uint16, torch.uint32, torch.uint64)

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        if t.dtype in self.REFUSED:
            raise RuntimeError("Invalid scalar type")
        for o, v in zip(out, self._exchange(t.clone())):
            assert o.shape == v.shape and o.dtype == v.dtype, "real all_gather needs equal shapes"
            o.copy_(v)

    def all_gather_object(self, out: list[Any], obj: Any) -> None:
        out[:] = self._exchange(obj)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        assert op == "sum"
        t.copy_(torch.stack(self._exchange(t.clone())).sum(0))


def on_ranks(world: int, fn: Callable[[DistEnv], Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``fn(env)`` on ``world`` pretend ranks at once; each rank's return value or exception."""
    fake = FakeDist(world)
    monkeypatch.setattr(gather, "torch_dist", fake)
    results: list[Any] = [None] * world

    def body(rank: int) -> None:
        fake.local.rank = rank
        try:
            results[rank] = fn(env_of(rank, world))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            # No barrier.abort() here: ranks still waking from the last collective would see
            # it broken. A rank that fails before a collective leaves the others to time out.
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a pretend rank hung"
    return results


# --- shard_indices ----------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 101, 1000])
def test_shards_are_contiguous_in_rank_order_and_cover_each_sample_once(n: int, world: int) -> None:
    shards = [shard_indices(n, env_of(r, world)) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(n))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shard_indices_rejects_a_negative_size() -> None:
    with pytest.raises(ValueError):
        shard_indices(-1, DistEnv())


# --- one process: no torch.distributed at all ---------------------------------------------

def test_one_process_never_touches_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gather, "torch_dist", None)  # any use would raise AttributeError
    env = DistEnv()
    t = torch.arange(6).reshape(3, 2)
    assert gather_tensor(t, env) is t
    assert gather_tensor(torch.tensor(2.5), env).tolist() == [2.5]
    assert torch.equal(gather_padded(t, env, 3), t)
    values = [1.0, 2.0]
    total = sum_over_ranks(values, env)
    assert total.dtype == torch.float64 and total.tolist() == values
    x = torch.ones(2)
    y = sum_over_ranks(x, env)
    y += 1
    assert x.tolist() == [1.0, 1.0]  # the input is not changed


def test_gather_padded_one_process_checks_the_count() -> None:
    assert gather_padded(torch.arange(5), DistEnv(), 5).tolist() == list(range(5))
    with pytest.raises(ValueError, match="cannot be a padded split"):
        gather_padded(torch.arange(5), DistEnv(), 4)


# --- several pretend ranks --------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 101])
def test_shards_gathered_give_dataset_order(monkeypatch: pytest.MonkeyPatch, n: int, world: int) -> None:
    data = torch.randn(n, 3, dtype=torch.float64)

    def work(env: DistEnv) -> torch.Tensor:
        mine = shard_indices(n, env)
        return gather_tensor(data[mine.start:mine.stop] * 2, env)

    for result in on_ranks(world, work, monkeypatch):
        assert torch.equal(result, data * 2)


def test_ragged_rows_come_back_in_rank_order_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    def work(env: DistEnv) -> torch.Tensor:
        return gather_tensor(torch.full((env.rank, 2), env.rank, dtype=torch.int16), env)

    expected = [[r, r] for r in range(4) for _ in range(r)]
    for result in on_ranks(4, work, monkeypatch):
        assert result.dtype == torch.int16 and result.tolist() == expected


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.int64, torch.float16])
def test_dtypes_survive(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    def work(env: DistEnv) -> torch.Tensor:
        return gather_tensor(torch.ones(env.rank + 1, dtype=dtype), env)

    for result in on_ranks(3, work, monkeypatch):
        assert result.dtype == dtype and result.shape == (6,)


def test_scalars_are_one_row_each(monkeypatch: pytest.MonkeyPatch) -> None:
    results = on_ranks(3, lambda env: gather_tensor(torch.tensor(float(env.rank)), env), monkeypatch)
    assert all(r.tolist() == [0.0, 1.0, 2.0] for r in results)


def test_all_ranks_empty_skips_the_data_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_calls: list[int] = []

    def work(env: DistEnv) -> torch.Tensor:
        out = gather_tensor(torch.empty(0, 4), env)
        fake_calls.append(gather.torch_dist.calls)
        return out

    for result in on_ranks(3, work, monkeypatch):
        assert result.shape == (0, 4)
    assert set(fake_calls) == {1}  # the metadata round only


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_mismatched_ranks_raise_the_same_error_everywhere(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    def work(env: DistEnv) -> torch.Tensor:
        if bad == "shape":
            return gather_tensor(torch.zeros(2, 3 + (env.rank == 1)), env)
        return gather_tensor(torch.zeros(2, 3, dtype=torch.float64 if env.rank == 1 else torch.float32), env)

    errors = on_ranks(3, work, monkeypatch)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    assert "rank 1:" in str(errors[0])


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 7, 101])
def test_gather_padded_undoes_distributed_sampler(monkeypatch: pytest.MonkeyPatch, n: int, world: int,
                                                  shuffle: bool) -> None:
    ds = TensorDataset(torch.arange(n))
    reference = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=shuffle, seed=3))

    def work(env: DistEnv) -> torch.Tensor:
        sampler = DistributedSampler(ds, num_replicas=env.world_size, rank=env.rank, shuffle=shuffle, seed=3)
        idx = torch.tensor(list(sampler), dtype=torch.int64)
        return gather_padded(torch.stack([idx, idx * 10], dim=1), env, n)

    for result in on_ranks(world, work, monkeypatch):
        assert result[:, 0].tolist() == reference  # each sample once, in the sampler's order
        assert torch.equal(result[:, 1], result[:, 0] * 10)


def test_gather_padded_refuses_what_is_not_a_padded_split(monkeypatch: pytest.MonkeyPatch) -> None:
    uneven = on_ranks(2, lambda env: gather_padded(torch.zeros(env.rank + 1), env, 3), monkeypatch)
    assert all(isinstance(e, ValueError) and "different numbers of rows" in str(e) for e in uneven)
    # drop_last=True: 7 samples over 2 ranks -> 3 each, one sample dropped, not padded
    dropped = on_ranks(2, lambda env: gather_padded(torch.zeros(3), env, 7), monkeypatch)
    assert all(isinstance(e, ValueError) and "drop_last" in str(e) for e in dropped)


def test_sum_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    results = on_ranks(3, lambda env: sum_over_ranks([1.0, float(env.rank)], env), monkeypatch)
    assert all(r.dtype == torch.float64 and r.tolist() == [3.0, 3.0] for r in results)


# --- evaluate uses the same blocks ----------------------------------------------------------

class FakeRankStrategy(Strategy):
    """One pretend rank: ``evaluate`` reduces through sum_over_ranks, so through FakeDist."""


def _float64_problem(n: int = 101):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    return TensorDataset(x, y), DataInfo("t", "classification", (8,), 3), model


def test_evaluate_counts_each_rank_block(monkeypatch: pytest.MonkeyPatch) -> None:
    ds, info, model = _float64_problem()
    seen: list[tuple[int, int]] = []

    # values: loss sum, predictions, correct, judged, samples (see evaluate)
    def counting(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
        seen.append((env.rank, int(values[4])))
        return sum_over_ranks(values, env)

    monkeypatch.setattr("scaleloop.loop.evaluation.sum_over_ranks", counting)
    on_ranks(3, lambda env: evaluate(model, ds, info, FakeRankStrategy(env), batch_size=8), monkeypatch)
    assert sorted(seen) == [(r, len(shard_indices(101, env_of(r, 3)))) for r in range(3)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 7, 512])
def test_evaluate_does_not_depend_on_world_size_or_batching(monkeypatch: pytest.MonkeyPatch, world: int,
                                                            batch_size: int) -> None:
    ds, info, model = _float64_problem()
    x, y = ds.tensors
    with torch.no_grad():
        out = model(x)
    results = on_ranks(world, lambda env: evaluate(model, ds, info, FakeRankStrategy(env), batch_size=batch_size),
                       monkeypatch)
    for r in results:
        assert r.samples == 101
        assert r.accuracy == float((out.argmax(1) == y).sum()) / 101
        assert r.loss == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-12, abs=0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_user_metrics_count_every_sample_once_over_ranks(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    ds, info, model = _float64_problem()
    x, y = ds.tensors
    with torch.no_grad():
        out = model(x)
    metrics = {
        "hits": lambda pred, target: (pred.argmax(1) == target).double(),   # one value per sample
        "batch_mean": lambda pred, target: pred.max(1).values.mean(),       # a batch mean, weighted by size
        "inputs": lambda pred, target: target.double() * 1000 + pred[:, 0],  # any lost or repeated sample shows
    }
    results = on_ranks(world, lambda env: evaluate(model, ds, info, FakeRankStrategy(env), batch_size=7,
                                                   metrics=metrics), monkeypatch)
    for r in results:
        assert r.metrics["hits"] == pytest.approx(float((out.argmax(1) == y).double().mean()), rel=1e-12)
        assert r.metrics["batch_mean"] == pytest.approx(float(out.max(1).values.mean()), rel=1e-12)
        assert r.metrics["inputs"] == pytest.approx(float((y.double() * 1000 + out[:, 0]).mean()), rel=1e-12)
