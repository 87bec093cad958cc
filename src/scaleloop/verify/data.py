"""``--check data``: does each rank load the right samples, each exactly once per epoch?

Three questions, answered from what the ranks recorded (their batches' indices and a SHA-256
of the data they actually received):

1. content: is each rank's batch exactly the dataset's samples at the indices it claims?
   (A dataset built differently in each process, e.g. from unseeded randomness, fails here.)
2. steps: do the N ranks of step s together train on the samples one process trains on?
3. coverage: over an epoch, is every sample used exactly once? Samplers that pad (torch's
   ``DistributedSampler`` repeats samples so that every rank gets as many) show up as duplicates.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler
from torch.utils.data._utils.collate import default_collate

from scaleloop.data.batch import split, take, tensors_of
from scaleloop.verify.hashing import digest


def load_samples(dataset: Dataset, indices: Sequence[int]) -> tuple[Any, Any]:
    """``(inputs, target)`` of the samples at ``indices``, built the way scaleloop's loader builds
    a batch (a mapping's target entry left out of the inputs, as :func:`batch_digest` hashes it)."""
    columns = tensors_of(dataset)
    if columns is not None:
        return split(take(columns, torch.as_tensor(list(indices), dtype=torch.long)))
    return split(default_collate([dataset[i] for i in indices]))


def batch_digest(inputs: Any, target: Any) -> str:
    """The SHA-256 of a batch's data, whether or not its target is also among the model's inputs."""
    if isinstance(inputs, dict) and target is not None:
        inputs = {k: v for k, v in inputs.items() if v is not target}
    return digest(inputs, target)


def expected_digest(dataset: Dataset, indices: Sequence[int], loaded: Sequence[bool] = (True, True)) -> str:
    """The SHA-256 a rank must report for a batch of these samples; ``loaded``: which of
    (inputs, target) it loads (a pipeline stage loads only what it uses, None in the other's place)."""
    x, y = load_samples(dataset, indices)
    return batch_digest(x if loaded[0] else None, y if loaded[1] else None)


def _expected(dataset: Dataset, m: dict[str, Any]) -> str:
    return expected_digest(dataset, m["indices"], m.get("loaded", (True, True)))


@dataclass(frozen=True)
class Coverage:
    """How often each sample was used in one epoch, over all ranks."""

    epoch: int
    n: int
    used: int                                   # sample slots used (duplicates counted)
    missing: list[int] = field(default_factory=list)
    duplicates: dict[int, int] = field(default_factory=dict)  # index -> times used

    @property
    def exact(self) -> bool:
        """Every sample exactly once."""
        return not self.missing and not self.duplicates


def coverage(index_lists: Iterable[Sequence[int]], n: int, epoch: int = 0) -> Coverage:
    """Count the samples that batches (or samplers' index lists) use, against ``range(n)``."""
    counts: Counter[int] = Counter()
    for indices in index_lists:
        counts.update(int(i) for i in indices)
    missing = [i for i in range(n) if counts[i] == 0]
    duplicates = {i: c for i, c in sorted(counts.items()) if c > 1}
    return Coverage(epoch, n, sum(counts.values()), missing, duplicates)


def distributed_sampler_coverage(n: int, world_size: int, *, shuffle: bool = True, seed: int = 0,
                                 epoch: int = 0, drop_last: bool = False) -> Coverage:
    """What torch's ``DistributedSampler`` gives ``world_size`` ranks over one epoch of ``n`` samples.

    Without ``drop_last`` it pads to a multiple of ``world_size`` by repeating samples from the
    start of the order, so those are used twice; with it, the tail is dropped (missing).
    """
    sized = range(n)  # the sampler only needs len()
    lists = []
    for rank in range(world_size):
        sampler = DistributedSampler(sized, num_replicas=world_size, rank=rank, shuffle=shuffle,  # type: ignore[arg-type]
                                     seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        lists.append(list(sampler))
    return coverage(lists, n, epoch)


def step_indices(micro: Sequence[dict[str, Any]], step: int) -> list[int]:
    """All sample indices one rank's record used in optimizer step ``step``, in order."""
    return [i for m in micro if m["step"] == step for i in m["indices"]]


def step_mismatches(reference: Sequence[dict[str, Any]], ranks: Sequence[dict[str, Any]],
                    steps: int) -> list[str]:
    """Steps where the ranks together did not train on exactly the reference's samples."""
    problems = []
    for step in range(1, steps + 1):
        want = Counter(step_indices(reference, step))
        got = Counter(i for r in ranks for i in step_indices(r["micro"], step))
        if not want or not got or want == got:
            continue
        twice = sorted(i for i, c in got.items() if c > 1)
        extra = sorted((got - want).elements())
        lost = sorted((want - got).elements())
        parts = [f"{sum(got.values())} sample slots over the ranks vs {sum(want.values())} in 1 process"]
        if twice:
            parts.append(f"used more than once: {_few(twice)}")
        if extra and extra != twice:
            parts.append(f"not in the reference step: {_few(extra)}")
        if lost:
            parts.append(f"missing: {_few(lost)}")
        problems.append(f"step {step}: " + "; ".join(parts))
    return problems


def content_mismatches(dataset: Dataset, ranks: Sequence[dict[str, Any]], key: str = "micro") -> list[str]:
    """Batches whose data is not the dataset's samples at their indices (by SHA-256)."""
    problems = []
    for r in ranks:
        for m in r[key]:
            if _expected(dataset, m) != m["sha"]:
                where = f"epoch {m['epoch'] + 1} " if "epoch" in m else ""
                problems.append(f"rank {r['rank']}, {where}step {m['step']} micro-step {m['micro'] + 1}: "
                                f"its data differs from the dataset's samples {_few(m['indices'])}")
    return problems


def _few(items: Sequence[int], k: int = 8) -> str:
    shown = ", ".join(str(i) for i in items[:k])
    return f"[{shown}{', ...' if len(items) > k else ''}] ({len(items)})" if len(items) > k else f"[{shown}]"


def batch_table(ranks: Sequence[dict[str, Any]], dataset: Dataset, accumulate: int, limit: int = 40) -> list[str]:
    """The per-rank SHA-256 of every verified batch, as table lines (the first ``limit`` rows)."""
    rows = sorted(((m["step"], m["micro"], r["rank"], m) for r in ranks for m in r["micro"]),
                  key=lambda t: t[:3])
    head = f"  {'step':>4}  {'micro':>5}  {'rank':>4}  {'samples':>7}  {'first indices':<22}  {'sha256':<12}  dataset"
    lines = [head if accumulate > 1 else head.replace(f"  {'micro':>5}", "")]
    for step, micro, rank, m in rows[:limit]:
        ok = "matches" if _expected(dataset, m) == m["sha"] else "DIFFERS"
        first = "[" + ", ".join(str(i) for i in m["indices"][:3]) + (", ...]" if len(m["indices"]) > 3 else "]")
        micro_col = f"  {micro + 1:>5}" if accumulate > 1 else ""
        lines.append(f"  {step:>4}{micro_col}  {rank:>4}  {len(m['indices']):>7}  {first:<22}  {m['sha'][:12]:<12}  {ok}")
    if len(rows) > limit:
        lines.append(f"  ... {len(rows) - limit} more batches (all compared below)")
    return lines


def format_coverage(cov: Coverage, world_size: int, dropped_by_design: int) -> tuple[bool, str]:
    """(passed, one line) for one epoch's coverage; ``dropped_by_design`` samples may be left out by design."""
    head = f"  epoch {cov.epoch + 1}: {cov.n:,} samples over {world_size} ranks"
    if cov.duplicates:
        return False, (f"{head}: {len(cov.duplicates)} used more than once (padding or overlapping shards): "
                       + _few([i for i in cov.duplicates]))
    if len(cov.missing) > dropped_by_design:
        return False, f"{head}: {len(cov.missing)} never used: {_few(cov.missing)}"
    if cov.missing:
        return True, (f"{head}: each used exactly once, except {len(cov.missing)} left out by design "
                      f"(the epoch's last, too-small step; see --drop-last): {_few(cov.missing)}")
    return True, f"{head}: each used exactly once, no duplicates, no padding"


def format_sampler_comparison(n: int, world_size: int, seed: int) -> str:
    """A line on what torch's DistributedSampler would do with the same set and ranks."""
    cov = distributed_sampler_coverage(n, world_size, seed=seed)
    if not cov.duplicates:
        return (f"  for comparison, torch's DistributedSampler over {world_size} ranks would pad nothing here "
                f"({n:,} divides by {world_size})")
    return (f"  for comparison, torch's DistributedSampler over {world_size} ranks would pad {len(cov.duplicates)} "
            f"sample(s), used twice per epoch: {_few(list(cov.duplicates))}")
