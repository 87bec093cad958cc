"""The data audit: batch digests, per-epoch coverage, and what a padding sampler does."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

from scaleloop.data.loader import ShardedLoader
from scaleloop.data.sampler import StepSampler
from scaleloop.verify.data import (content_mismatches, coverage, distributed_sampler_coverage, expected_digest,
                                   format_coverage, format_sampler_comparison, step_mismatches)
from scaleloop.verify.hashing import digest


def test_distributed_sampler_padding_is_listed_as_duplicates() -> None:
    # 10 samples over 3 ranks: DistributedSampler pads to 12 by repeating 2 samples.
    padded = distributed_sampler_coverage(10, 3, seed=0)
    assert not padded.exact and padded.used == 12 and padded.missing == []
    assert len(padded.duplicates) == 2 and set(padded.duplicates.values()) == {2}
    ok, line = format_coverage(padded, 3, dropped_by_design=0)
    assert not ok and "2 used more than once" in line
    dropped = distributed_sampler_coverage(10, 3, drop_last=True)
    assert len(dropped.missing) == 1 and dropped.duplicates == {}
    assert distributed_sampler_coverage(12, 3).exact
    assert "would pad 2 sample(s)" in format_sampler_comparison(10, 3, seed=0)
    assert "would pad nothing" in format_sampler_comparison(12, 3, seed=0)


def test_scaleloop_plan_uses_every_sample_exactly_once_over_ranks() -> None:
    # 1000 samples, global batch 64, 2 ranks x 2 micro-steps: the 40-sample tail is kept.
    lists = [mb.indices.tolist() for rank in range(2)
             for mb in StepSampler(1000, 64, world_size=2, rank=rank, accumulate=2, seed=3).micro_batches(epoch=1)]
    cov = coverage(lists, 1000, epoch=1)
    assert cov.exact and cov.used == 1000
    assert format_coverage(cov, 2, dropped_by_design=0) == (True, "  epoch 2: 1,000 samples over 2 ranks: each used "
                                                             "exactly once, no duplicates, no padding")
    short = coverage(lists[:-1], 1000)
    assert short.missing and not format_coverage(short, 2, dropped_by_design=0)[0]


def _record(rank: int, micro: list[tuple[int, list[int]]], dataset: Dataset) -> dict:
    return {"rank": rank, "micro": [{"step": s, "micro": 0, "indices": idx, "sha": expected_digest(dataset, idx)}
                                    for s, idx in micro]}


def test_steps_are_compared_with_the_reference_and_contents_with_the_dataset() -> None:
    data = TensorDataset(torch.arange(20.0).reshape(10, 2), torch.arange(10))
    reference = _record(0, [(1, [0, 1, 2, 3]), (2, [4, 5, 6, 7])], data)["micro"]
    ranks = [_record(0, [(1, [0, 1]), (2, [4, 5])], data), _record(1, [(1, [2, 3]), (2, [6, 7])], data)]
    assert step_mismatches(reference, ranks, 2) == [] and content_mismatches(data, ranks) == []
    padded = [_record(0, [(1, [0, 1]), (2, [4, 5])], data), _record(1, [(1, [2, 2]), (2, [6, 7])], data)]
    problems = step_mismatches(reference, padded, 2)
    assert len(problems) == 1 and problems[0].startswith("step 1:") and "used more than once: [2]" in problems[0]
    assert "missing: [3]" in problems[0]
    ranks[1]["micro"][1]["sha"] = "0" * 64  # rank 1 received other data than the dataset holds
    bad = content_mismatches(data, ranks)
    assert len(bad) == 1 and bad[0].startswith("rank 1, step 2")


class Squares(Dataset):
    """A map-style dataset that is not a TensorDataset: read sample by sample, collated."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i), float(i * i)]), i % 3


def test_expected_digest_matches_what_the_loader_yields_on_both_paths() -> None:
    for dataset in (Squares(), TensorDataset(torch.randn(12, 2), torch.arange(12))):
        sampler = StepSampler(12, 4, world_size=2, rank=1, seed=5)
        for batch in ShardedLoader(dataset, sampler, torch.device("cpu")):
            x, y = batch
            assert digest(x, y) == expected_digest(dataset, batch.indices.tolist())


def test_digest_depends_on_dtype_shape_and_values() -> None:
    t = torch.arange(4, dtype=torch.float32)
    assert digest(t) == digest(t.clone()) != digest(t.double())
    assert digest(t) != digest(t.reshape(2, 2)) and digest(t) != digest(t + 1)
    assert digest(torch.ones(2, dtype=torch.bfloat16)) != digest(torch.ones(2, dtype=torch.float16))
