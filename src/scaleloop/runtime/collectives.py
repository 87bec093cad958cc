"""Collectives as plain functions of a ``DistEnv``, and exact distributed metrics.

``sum_over_ranks``, ``gather_object``, ``broadcast_object`` and ``barrier`` are what the loop,
checkpoints, verify and bench use to agree across ranks. The rest says which samples this
rank evaluates and puts the results together.

``scaleloop.loop.evaluation`` uses these for loss and accuracy; they are public for your own metrics
(F1, AUC, per-class counts, predictions written to disk), which need every sample exactly once:

    mine = shard_indices(len(test_set), env)              # contiguous block, no padding
    loader = DataLoader(Subset(test_set, mine), batch_size=256)
    with torch.no_grad():
        preds = torch.cat([model(x.to(env.device)).argmax(1) for x, _ in loader])
    all_preds = gather_tensor(preds, env)                  # len(test_set) rows, dataset order

torch's ``DistributedSampler`` instead deals samples out round-robin and pads the last round
by repeating samples, so that every rank gets the same count; ``gather_padded`` undoes both.

Each function is a collective when ``env.world_size > 1``: every rank must call it, in the
same order. With one process none of them touches ``torch.distributed``.
"""
from __future__ import annotations

import zlib
from typing import Any, Sequence, Union

import torch
import torch.distributed as torch_dist

from scaleloop.runtime.dist import DistEnv


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous pieces of ``n`` items; the first ``n % parts`` get one more."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_indices(n: int, env: DistEnv) -> range:
    """The samples of an ``n``-sample set that this rank evaluates: one contiguous block.

    Blocks follow rank order and differ in size by at most one (the first ``n % world_size``
    ranks get one more); nothing is padded, so a rank may get none when ``n < world_size``.
    Concatenating the ranks' results in rank order (``gather_tensor``) gives dataset order.
    """
    if n < 0:
        raise ValueError(f"shard_indices: n must be >= 0, got {n}")
    sizes = split_sizes(n, env.world_size)
    start = sum(sizes[: env.rank])
    return range(start, start + sizes[env.rank])


def gather_tensor(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Every rank's ``t`` concatenated along dim 0 in rank order, returned on every rank.

    Ranks may hold different numbers of rows (including none); the other dimensions and the
    dtype must agree, else every rank raises the same ``ValueError``. A 0-d tensor counts as
    one row. The result is on ``t``'s device (communication happens on ``env.device``, which
    NCCL needs). With one process, ``t`` itself is returned (as one row if it is 0-d).
    """
    rows = t.reshape(1) if t.dim() == 0 else t
    if env.world_size == 1:
        return rows
    return torch.cat(_gather_parts(rows, env)).to(t.device)


def gather_padded(t: torch.Tensor, env: DistEnv, n_total: int) -> torch.Tensor:
    """Results laid out as ``torch.utils.data.DistributedSampler`` deals them, as ``n_total`` rows.

    DistributedSampler (``drop_last=False``) pads its index list by repeating its first
    samples until it divides by the world size, then gives rank ``r`` positions ``r, r+W,
    r+2W, ...``. This interleaves the ranks' rows back into that list and cuts the padding,
    so each sample appears once: in dataset order with ``shuffle=False``, in the sampler's
    order otherwise. Every rank must pass the same number of rows (the sampler guarantees it).
    """
    rows = t.reshape(1) if t.dim() == 0 else t
    parts = [rows] if env.world_size == 1 else _gather_parts(rows, env)
    if len({p.shape[0] for p in parts}) != 1:
        raise ValueError("gather_padded: ranks passed different numbers of rows "
                         f"({', '.join(str(p.shape[0]) for p in parts)}); DistributedSampler gives "
                         "every rank the same count, so these are not its results (use gather_tensor)")
    per_rank = parts[0].shape[0]
    total = per_rank * len(parts)
    if not total - len(parts) < n_total <= total:
        raise ValueError(f"gather_padded: {len(parts)} rank(s) x {per_rank} row(s) cannot be a padded "
                         f"split of {n_total} samples (DistributedSampler pads fewer than "
                         f"{len(parts)}); with drop_last=True samples are dropped, not padded")
    # Position p of the sampler's list went to rank p % W as its row p // W.
    interleaved = torch.stack(parts, dim=1).reshape(total, *rows.shape[1:])
    return interleaved[:n_total].to(t.device)


def sum_over_ranks(values: Union[torch.Tensor, Sequence[float]], env: DistEnv) -> torch.Tensor:
    """Element-wise sum over ranks, returned on every rank (the input is left unchanged).

    Numbers become a float64 tensor on ``env.device``: counts stay exact up to 2**53, and
    sums of per-sample losses do not lose digits to float32.
    """
    if isinstance(values, torch.Tensor):
        total = values.detach().clone()
    else:
        total = torch.tensor(list(values), dtype=torch.float64, device=env.device)
    if env.world_size == 1:
        return total
    out = total.to(env.device)
    torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM)
    return out.to(total.device)


def gather_object(obj: Any, env: DistEnv) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank."""
    if env.world_size == 1:
        return [obj]
    out: list[Any] = [None] * env.world_size
    torch_dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, env: DistEnv, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (the others' ``obj`` is ignored)."""
    if env.world_size == 1:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(env: DistEnv) -> None:
    """Wait until every rank has called it."""
    if env.world_size > 1:
        torch_dist.barrier()


def _gather_parts(rows: torch.Tensor, env: DistEnv) -> list[torch.Tensor]:
    """Each rank's ``rows`` (on ``env.device``), in rank order: sizes first, then padded data."""
    device = env.device
    rows = rows.detach()  # collectives carry no gradient; results are for metrics
    # One round of metadata: the row count, plus checksums of dtype and row shape, so that a
    # mismatch is found by every rank alike (rather than a hang or a garbled result).
    meta = torch.tensor([rows.shape[0], _code(str(rows.dtype)), _code(str(tuple(rows.shape[1:])))],
                        dtype=torch.int64, device=device)
    metas = [torch.empty_like(meta) for _ in range(env.world_size)]
    torch_dist.all_gather(metas, meta)
    metas_cpu = [m.tolist() for m in metas]
    if len({(m[1], m[2]) for m in metas_cpu}) != 1:
        described: list[object] = [None] * env.world_size
        torch_dist.all_gather_object(described, f"{rows.dtype} rows of shape {tuple(rows.shape[1:])}")
        raise ValueError("gather_tensor: ranks passed tensors of different dtype or row shape: "
                         + "; ".join(f"rank {r}: {d}" for r, d in enumerate(described)))
    sizes = [m[0] for m in metas_cpu]
    longest = max(sizes)
    if longest == 0:  # all ranks know it, so all skip the collective
        return [rows.to(device)] * env.world_size
    # all_gather needs equal shapes: pad every rank to the longest, then cut the padding off.
    wire = _on_the_wire(rows.to(device))
    padded = torch.zeros((longest, *wire.shape[1:]), dtype=wire.dtype, device=device)
    padded[: rows.shape[0]] = wire
    parts = [torch.empty_like(padded) for _ in range(env.world_size)]
    torch_dist.all_gather(parts, padded)
    return [_off_the_wire(p[:k], rows.dtype) for p, k in zip(parts, sizes)]


# Integer types that Gloo's collectives refuse ("Invalid scalar type"), and what they travel as:
# wider signed integers that hold every value exactly, or (uint64) the same bits as int64.
_WIDENED = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _on_the_wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype every backend gathers (a metric may return any integer type)."""
    if t.dtype == torch.uint64:
        return t.view(torch.int64)
    wider = _WIDENED.get(t.dtype)
    return t if wider is None else t.to(wider)


def _off_the_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == dtype:
        return t
    return t.view(dtype) if dtype == torch.uint64 else t.to(dtype)


def _code(text: str) -> int:
    # crc32 rather than hash(): Python salts str hashes per process.
    return zlib.crc32(text.encode())
