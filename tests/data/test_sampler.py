"""Tests for scaleloop.data.sampler: the global-batch StepSampler (see the module docstring)."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from scaleloop.data.sampler import MicroBatch, StepSampler, split_sizes


def samplers(n: int, batch: int, world: int, acc: int, **kw) -> list[StepSampler]:
    return [StepSampler(n, batch, world_size=world, rank=r, accumulate=acc, **kw) for r in range(world)]


def all_micro(n: int, batch: int, world: int, acc: int, epoch: int = 0, **kw) -> list[tuple[int, MicroBatch]]:
    """(rank, micro-batch) for every rank of the job."""
    return [(r, mb) for r, p in enumerate(samplers(n, batch, world, acc, **kw)) for mb in p.micro_batches(epoch)]


def by_step(micro: list[tuple[int, MicroBatch]]) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = defaultdict(list)
    for _, mb in micro:
        steps[mb.step].extend(mb.indices.tolist())
    return steps


# (n, global batch): sizes that divide the batch, leave a tail every config keeps (>= 12 = 3*4),
# and leave a small tail.
SIZES = [(96, 24), (100, 24), (107, 24), (24, 24), (30, 24)]
LAYOUTS = [(w, k) for w in (1, 2, 3) for k in (1, 2, 4)]


# --- split_sizes ------------------------------------------------------------------------

@pytest.mark.parametrize("n,parts,expected", [(10, 3, [4, 3, 3]), (9, 3, [3, 3, 3]), (2, 4, [1, 1, 0, 0]),
                                              (0, 2, [0, 0]), (7, 1, [7])])
def test_split_sizes(n: int, parts: int, expected: list[int]) -> None:
    assert split_sizes(n, parts) == expected
    assert sum(split_sizes(n, parts)) == n


# --- coverage ---------------------------------------------------------------------------

@pytest.mark.parametrize("n,batch", SIZES)
@pytest.mark.parametrize("world,acc", LAYOUTS)
def test_every_sample_once_per_epoch(n: int, batch: int, world: int, acc: int) -> None:
    sampler = StepSampler(n, batch, world_size=world, accumulate=acc)
    for epoch in (0, 1):
        seen = [i for _, mb in all_micro(n, batch, world, acc, epoch) for i in mb.indices.tolist()]
        assert len(seen) == len(set(seen)) == sampler.used_per_epoch  # nothing twice
        assert sampler.used_per_epoch + sampler.dropped_per_epoch == n
        assert set(seen) <= set(range(n))
        tail = n % batch
        expect_dropped = tail if 0 < tail < world * acc else 0
        assert sampler.dropped_per_epoch == expect_dropped
        if not expect_dropped:
            assert sorted(seen) == list(range(n))  # every sample exactly once


@pytest.mark.parametrize("n,batch", [(96, 24), (108, 24), (24, 24)])
def test_step_covers_same_samples_whatever_the_layout(n: int, batch: int) -> None:
    reference = by_step(all_micro(n, batch, 1, 1, epoch=3))
    for world, acc in LAYOUTS:
        steps = by_step(all_micro(n, batch, world, acc, epoch=3))
        assert steps.keys() == reference.keys()
        for s in reference:
            assert sorted(steps[s]) == sorted(reference[s]), (world, acc, s)


@pytest.mark.parametrize("n,batch", [(96, 24), (108, 24)])
@pytest.mark.parametrize("acc", [1, 2, 4])
def test_micro_step_covers_same_samples_whatever_the_world_size(n: int, batch: int, acc: int) -> None:
    def micro_sets(world: int) -> dict[tuple[int, int], list[int]]:
        out: dict[tuple[int, int], list[int]] = defaultdict(list)
        for _, mb in all_micro(n, batch, world, acc):
            out[(mb.step, mb.micro)].extend(mb.indices.tolist())
        return out

    reference = micro_sets(1)
    for world in (2, 3):
        other = micro_sets(world)
        assert other.keys() == reference.keys()
        for key in reference:
            assert sorted(other[key]) == sorted(reference[key])


def test_step_is_cut_into_micro_steps_then_rank_blocks() -> None:
    n, batch, world, acc = 108, 24, 3, 2
    ref = by_step(all_micro(n, batch, 1, 1))
    micro = all_micro(n, batch, world, acc)
    for s in ref:
        concat = [i for k in range(acc) for r in range(world)
                  for rank, mb in micro if mb.step == s and mb.micro == k and rank == r
                  for i in mb.indices.tolist()]
        assert concat == ref[s]


@pytest.mark.parametrize("world,acc", LAYOUTS)
def test_ranks_are_disjoint(world: int, acc: int) -> None:
    per_rank = [set(i for mb in p.micro_batches(0) for i in mb.indices.tolist())
                for p in samplers(100, 24, world, acc)]
    for a in range(world):
        for b in range(a + 1, world):
            assert not per_rank[a] & per_rank[b]


def test_micro_batch_sizes_differ_by_at_most_one() -> None:
    # 100 = 4 * 24 + 4: last step of 4 samples over 2 ranks x 2 micro-steps -> 1 each
    for n, batch, world, acc in [(100, 24, 2, 2), (107, 24, 3, 2), (30, 24, 2, 3)]:
        for s, group in _group_steps(all_micro(n, batch, world, acc)).items():
            sizes = [len(mb.indices) for _, mb in group]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _group_steps(micro: list[tuple[int, MicroBatch]]) -> dict[int, list[tuple[int, MicroBatch]]]:
    out: dict[int, list[tuple[int, MicroBatch]]] = defaultdict(list)
    for r, mb in micro:
        out[mb.step].append((r, mb))
    return out


# --- order ------------------------------------------------------------------------------

def test_same_permutation_on_every_rank() -> None:
    orders = [p.order(5) for p in samplers(50, 10, 3, 1, seed=7)]
    for o in orders[1:]:
        assert torch.equal(o, orders[0])


def test_order_is_a_permutation_that_changes_per_epoch() -> None:
    sampler = StepSampler(50, 10, seed=1)
    o0, o1 = sampler.order(0), sampler.order(1)
    assert sorted(o0.tolist()) == list(range(50))
    assert sorted(o1.tolist()) == list(range(50))
    assert not torch.equal(o0, o1)
    assert not torch.equal(o0, torch.arange(50))


def test_order_is_deterministic_per_seed() -> None:
    a, b, c = StepSampler(50, 10, seed=3), StepSampler(50, 10, seed=3), StepSampler(50, 10, seed=4)
    assert torch.equal(a.order(2), b.order(2))
    assert not torch.equal(a.order(2), c.order(2))
    # the micro-batches, not only the order, repeat
    first = [mb.indices.tolist() for mb in a.micro_batches(2)]
    assert first == [mb.indices.tolist() for mb in b.micro_batches(2)]


def test_no_shuffle_is_arange_order() -> None:
    sampler = StepSampler(10, 4, shuffle=False)
    assert torch.equal(sampler.order(0), torch.arange(10))
    assert torch.equal(sampler.order(9), torch.arange(10))
    assert [mb.indices.tolist() for mb in sampler.micro_batches(0)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    rank1 = StepSampler(10, 4, shuffle=False, world_size=2, rank=1)
    assert [mb.indices.tolist() for mb in rank1.micro_batches(0)] == [[2, 3], [6, 7], [9]]


# --- loss weights -----------------------------------------------------------------------

@pytest.mark.parametrize("n,batch", SIZES)
@pytest.mark.parametrize("world,acc", LAYOUTS)
def test_loss_scale_weights(n: int, batch: int, world: int, acc: int) -> None:
    for s, group in _group_steps(all_micro(n, batch, world, acc)).items():
        step_samples = {mb.step_samples for _, mb in group}
        assert len(step_samples) == 1
        (total,) = step_samples
        assert total == sum(len(mb.indices) for _, mb in group)
        # the update is the mean over the step: weights sum to 1 after DDP's 1/W average
        assert sum(mb.loss_scale for _, mb in group) / world == pytest.approx(1.0)
        for _, mb in group:
            assert mb.loss_scale == pytest.approx(world * len(mb.indices) / mb.step_samples)
        # full steps of equal pieces give the textbook 1/K weight per micro-batch
        if total == batch and batch % (world * acc) == 0:
            assert all(mb.loss_scale == pytest.approx(1 / acc) for _, mb in group)


def test_last_micro_flags() -> None:
    sampler = StepSampler(40, 8, accumulate=4)
    micro = list(sampler.micro_batches(0))
    assert [mb.micro for mb in micro[:4]] == [0, 1, 2, 3]
    assert [mb.last_micro for mb in micro] == [m == 3 for m in [mb.micro for mb in micro]]
    assert sum(mb.last_micro for mb in micro) == sampler.steps_per_epoch == 5


# --- tails ------------------------------------------------------------------------------

def test_small_tail_is_dropped_and_reported() -> None:
    # 50 = 2 * 24 + 2; with 2 ranks x 2 micro-steps a 2-sample tail cannot feed every piece
    sampler = StepSampler(50, 24, world_size=2, accumulate=2)
    assert sampler.steps_per_epoch == 2
    assert sampler.dropped_per_epoch == 2 and sampler.used_per_epoch == 48
    # with one worker and no accumulation the same tail is kept
    single = StepSampler(50, 24)
    assert single.steps_per_epoch == 3 and single.dropped_per_epoch == 0
    assert len(single.step_indices(0, 2)) == 2


def test_tail_equal_to_pieces_is_kept() -> None:
    sampler = StepSampler(52, 24, world_size=2, accumulate=2)  # tail 4 = W*K
    assert sampler.steps_per_epoch == 3 and sampler.dropped_per_epoch == 0
    sizes = [len(mb.indices) for r in range(2)
             for mb in StepSampler(52, 24, world_size=2, rank=r, accumulate=2).micro_batches(0) if mb.step == 2]
    assert sizes == [1, 1, 1, 1]


def test_drop_last_drops_the_partial_step() -> None:
    sampler = StepSampler(100, 24, drop_last=True)
    assert sampler.steps_per_epoch == 4
    assert sampler.dropped_per_epoch == 4 and sampler.used_per_epoch == 96
    assert all(mb.step_samples == 24 for mb in sampler.micro_batches(0))
    exact = StepSampler(96, 24, drop_last=True)
    assert exact.steps_per_epoch == 4 and exact.dropped_per_epoch == 0


def test_dataset_smaller_than_the_pieces_yields_nothing() -> None:
    sampler = StepSampler(3, 24, world_size=2, accumulate=2)
    assert sampler.steps_per_epoch == 0 and sampler.dropped_per_epoch == 3
    assert list(sampler.micro_batches(0)) == []


def test_empty_dataset_is_an_error() -> None:
    with pytest.raises(ValueError):
        StepSampler(0, 8)


# --- resuming ---------------------------------------------------------------------------

def test_start_step_resumes_at_the_right_step() -> None:
    sampler = StepSampler(100, 16, world_size=2, rank=1, accumulate=2, seed=9)
    full = list(sampler.micro_batches(4))
    resumed = list(sampler.micro_batches(4, start_step=3))
    assert resumed[0].step == 3 and resumed[0].micro == 0
    tail = [mb for mb in full if mb.step >= 3]
    assert [(mb.step, mb.micro, mb.indices.tolist()) for mb in resumed] == \
        [(mb.step, mb.micro, mb.indices.tolist()) for mb in tail]
    assert sampler.micro_batches_per_epoch() == len(full) == sampler.steps_per_epoch * 2
    assert sampler.micro_batches_per_epoch(3) == len(resumed)
    assert sampler.micro_batches_per_epoch(99) == 0
    assert list(sampler.micro_batches(4, start_step=sampler.steps_per_epoch)) == []


def test_step_indices_match_the_micro_batches() -> None:
    sampler = StepSampler(70, 16, seed=2)
    for s in range(sampler.steps_per_epoch):
        joined = torch.cat([mb.indices for mb in sampler.micro_batches(1) if mb.step == s])
        assert torch.equal(sampler.step_indices(1, s), joined)
        assert torch.equal(joined, sampler.order(1)[s * 16:(s + 1) * 16])
