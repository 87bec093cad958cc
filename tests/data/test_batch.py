"""Tests for scaleloop.data.batch: the one rule for inputs and target, and the model call."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from scaleloop.data.batch import (DictTensorDataset, call_model, first_tensor, keeps_target, move, split,
                                  takes_keyword, tensors_of)
from scaleloop.data.loader import ShardedLoader
from scaleloop.data.sampler import StepSampler
from scaleloop.errors import UsageError

CPU = torch.device("cpu")


def test_pairs_tuples_and_mappings_split_into_inputs_and_target() -> None:
    x, y, z = torch.zeros(2, 3), torch.ones(2), torch.full((2, 4), 2.0)
    assert split((x, y)) == (x, y)
    inputs, target = split((x, z, y))
    assert isinstance(inputs, tuple) and inputs[0] is x and inputs[1] is z and target is y
    inputs, target = split([x, z, y])  # the DataLoader collates tuples into lists
    assert inputs[0] is x and inputs[1] is z and target is y
    sample = {"input_ids": x, "attention_mask": z, "labels": y}
    assert split(sample) == ({"input_ids": x, "attention_mask": z}, y)
    assert split(sample, keep_target=True) == (sample, y)
    assert split({"features": x, "target": y}) == ({"features": x}, y)
    assert split({"input_ids": x}) == ({"input_ids": x}, None)


@pytest.mark.parametrize("sample, named", [(torch.zeros(3), "a tensor [3] float32"), ((torch.zeros(3),), "a tuple of 1"),
                                           ("text", "a str")])
def test_a_sample_no_rule_reads_is_named_in_one_line(sample, named: str) -> None:
    with pytest.raises(UsageError) as info:
        split(sample)
    assert named in str(info.value) and "\n" not in str(info.value)


class Recorder(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


def test_the_model_is_called_positionally_or_by_keyword() -> None:
    m, x, z = Recorder(), torch.zeros(1), torch.ones(1)
    assert call_model(m, x) == ((x,), {})
    assert call_model(m, (x, z)) == ((x, z), {})
    assert call_model(m, [x, z]) == ((x, z), {})
    assert call_model(m, {"a": x}) == ((), {"a": x})


class WithLabels(nn.Module):
    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return input_ids


class Plain(nn.Module):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids


class AnyKeywords(nn.Module):
    def forward(self, **kwargs: torch.Tensor) -> torch.Tensor:
        return kwargs["input_ids"]


class Inner(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class CallsInnerWrongly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids, scale=2)   # the user's own bug, inside forward


def test_an_entry_forward_does_not_take_is_one_line_and_a_bug_inside_forward_stays_its_own() -> None:
    with pytest.raises(UsageError, match=r"the batch's entries attention_mask, input_ids are the model's keyword "
                                         r"arguments, and .*unexpected keyword argument 'attention_mask'"):
        call_model(Plain(), {"input_ids": torch.zeros(2), "attention_mask": torch.ones(2)})
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale'"):
        call_model(CallsInnerWrongly(), {"input_ids": torch.zeros(2)})


def test_the_target_is_passed_only_to_a_model_that_takes_it() -> None:
    data = DictTensorDataset(input_ids=torch.zeros(4, 2), labels=torch.zeros(4))
    assert takes_keyword(WithLabels(), "labels") and keeps_target(WithLabels(), data)
    assert not takes_keyword(Plain(), "labels") and not keeps_target(Plain(), data)
    assert keeps_target(AnyKeywords(), data)
    # an (x, y) pair: its y goes by the keyword the forward names
    assert keeps_target(WithLabels(), TensorDataset(torch.zeros(4, 2), torch.zeros(4))) == ("input_ids", "labels")
    # ... but not next tokens to a causal LM's labels, which it shifts itself (it would learn the token after next)
    assert not keeps_target(WithLabels(), TensorDataset(torch.zeros(4, 2), torch.zeros(4)), task="lm")
    assert keeps_target(TakesTargets(), TensorDataset(torch.zeros(4, 2), torch.zeros(4)), task="lm") == ("idx", "targets")


class TakesTargets(nn.Module):
    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        return idx


def test_a_pair_s_target_reaches_a_forward_that_names_a_target_keyword() -> None:
    """nanoGPT's ``forward(idx, targets=None)`` on (x, y) samples: ``model(idx=x, targets=y)``, in both
    the fast path and the DataLoader path; a ``**kwargs`` forward is not guessed at."""
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    data = TensorDataset(x, y)
    route = keeps_target(TakesTargets(), data)
    assert route == ("idx", "targets")
    assert not keeps_target(Plain(), data) and not keeps_target(AnyKeywords(), data)
    inputs, target = split((x, y), route)
    assert inputs.keys() == {"idx", "targets"} and inputs["targets"] is y and target is y
    sampler = StepSampler(6, 3, world_size=1, rank=0, seed=0)
    for ds in (data, Items((x, y))):
        loader = ShardedLoader(ds, sampler, CPU, keep_target=route)
        loader.set_epoch(0)
        for batch in loader:
            given, target = batch
            assert torch.equal(given["idx"], x[batch.indices]) and torch.equal(given["targets"], target)
            assert call_model(TakesTargets(), given) is given["idx"]


def test_in_memory_columns_are_found_only_where_indexing_is_plain() -> None:
    a, b, c = torch.zeros(5, 2), torch.ones(5), torch.arange(5)
    assert tensors_of(TensorDataset(a, b, c)) == (a, b, c)
    assert tensors_of(TensorDataset(a)) is None  # no target
    named = tensors_of(DictTensorDataset(x=a, labels=c))
    assert isinstance(named, dict) and named["x"] is a

    class Augmented(DictTensorDataset):
        def __getitem__(self, i: int):
            return super().__getitem__(i)

    assert tensors_of(Augmented(x=a, labels=c)) is None
    with pytest.raises(ValueError, match="same first dimension"):
        DictTensorDataset(x=a, labels=torch.zeros(3))


def test_move_and_first_tensor_go_through_nesting() -> None:
    nested = {"a": (torch.zeros(1), [torch.ones(2)]), "b": 3}
    moved = move(nested, CPU)
    assert moved["b"] == 3 and torch.equal(moved["a"][1][0], torch.ones(2)) and isinstance(moved["a"], tuple)
    assert torch.equal(first_tensor({"n": None, "t": [torch.ones(3)]}), torch.ones(3))
    assert first_tensor(("x", 1)) is None


class Items(Dataset):
    """Map-style dicts or triples, read one by one (the DataLoader path)."""

    def __init__(self, columns) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())) if isinstance(self.columns, dict) else self.columns[0])

    def __getitem__(self, i: int):
        if isinstance(self.columns, dict):
            return {k: v[i] for k, v in self.columns.items()}
        return tuple(t[i] for t in self.columns)


def _flatten(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj
    return [t for v in values for t in _flatten(v)]


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("keep_target", [False, True])
@pytest.mark.parametrize("world, rank, accumulate", [(1, 0, 1), (2, 1, 3)])
def test_fast_path_and_dataloader_path_agree_for_several_and_named_tensors(named: bool, keep_target: bool,
                                                                           world: int, rank: int,
                                                                           accumulate: int) -> None:
    g = torch.Generator().manual_seed(0)
    a, b, y = torch.randn(37, 3, generator=g), torch.randint(0, 9, (37, 4), generator=g), torch.randint(0, 5, (37,), generator=g)
    sampler = StepSampler(37, 12, world_size=world, rank=rank, accumulate=accumulate, seed=3)
    if named:
        fast_ds, slow_ds = DictTensorDataset(a=a, b=b, labels=y), Items({"a": a, "b": b, "labels": y})
    else:
        fast_ds, slow_ds = TensorDataset(a, b, y), Items((a, b, y))
    fast, slow = (ShardedLoader(ds, sampler, CPU, keep_target=keep_target) for ds in (fast_ds, slow_ds))
    assert fast.in_memory and not slow.in_memory
    for epoch in (0, 1):
        fast.set_epoch(epoch)
        slow.set_epoch(epoch)
        pairs = list(zip(fast, slow))
        assert len(pairs) == len(fast) > 0
        for one, other in pairs:
            (xa, ya), (xb, yb) = one, other
            assert type(xa) is (dict if named else tuple) and type(xb) is type(xa)
            assert torch.equal(ya, yb) and all(torch.equal(p, q) for p, q in zip(_flatten(xa), _flatten(xb)))
            assert torch.equal(ya, y[one.indices])
            assert len(one) == len(other) == len(one.indices)
            if named:
                assert ("labels" in xa) == keep_target
            assert one.loss_scale == other.loss_scale


def test_uneven_micro_batches_of_named_tensors_weigh_by_samples() -> None:
    """Each micro-batch weighs its share of the step's samples (times the world size: gradients
    are then averaged over ranks), whatever the tensors are."""
    n, batch, world, accumulate = 41, 12, 2, 2  # the last step: 5 samples in 4 pieces
    data = DictTensorDataset(a=torch.randn(n, 2), labels=torch.zeros(n))
    per_step: dict[int, list[tuple[int, float]]] = {}
    for rank in range(world):
        sampler = StepSampler(n, batch, world_size=world, rank=rank, accumulate=accumulate, seed=0)
        for b in ShardedLoader(data, sampler, CPU):
            per_step.setdefault(b.step, []).append((len(b), b.loss_scale))
    assert sum(size for pieces in per_step.values() for size, _ in pieces) == n - sampler.dropped_per_epoch
    assert any(len({size for size, _ in pieces}) > 1 for pieces in per_step.values())  # uneven pieces
    for pieces in per_step.values():
        total = sum(size for size, _ in pieces)
        assert sum(w for _, w in pieces) / world == pytest.approx(1.0)
        assert all(w == pytest.approx(world * size / total) for size, w in pieces)
