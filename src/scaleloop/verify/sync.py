"""``--check sync``: are the replicas still identical? A hash of every parameter and buffer on every rank.

Data parallelism keeps N copies of the model that must stay bit-for-bit equal: every rank
starts from rank 0's weights and applies the same averaged gradient. A copy that drifts
(a buffer updated from local data, a parameter left out of the all-reduce, a rank-dependent
initialisation) trains a different model on that rank without any error. Comparing SHA-256
digests finds it, and the first diverging tensor, in ``state_dict`` order, says where to look.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn

from scaleloop.strategies.base import Strategy
from scaleloop.verify.hashing import full_tensor, state_digests


def check_sync(strategy: Strategy, module: nn.Module) -> Optional[dict[str, Any]]:
    """Compare every rank's parameters and buffers; the result on rank 0, None elsewhere.

    A collective: every rank must call it at the same point. The result lists each diverging
    tensor (name, parameter or buffer, the ranks whose copy differs from rank 0's) and, for
    the first one, the largest absolute difference per rank.
    """
    digests = state_digests(module)
    parameters = {name for name, _ in module.named_parameters()}
    every = strategy.gather_object(digests)  # on every rank, so all take the same branch below
    diverging = []
    for name, mine in every[0].items():
        ranks = [r for r, d in enumerate(every) if d.get(name) != mine]
        if ranks:
            diverging.append({"name": name, "kind": "parameter" if name in parameters else "buffer",
                              "ranks": ranks})
    if diverging:
        first = diverging[0]
        copies = strategy.gather_object(full_tensor(module.state_dict()[first["name"]]).detach().cpu())
        base = copies[0].double()
        first["max_abs"] = [[r, float((copies[r].double() - base).abs().max())
                             if copies[r].shape == base.shape else float("inf")] for r in first["ranks"]]
    if strategy.env.rank != 0:
        return None
    return {"world_size": len(every), "tensors": len(every[0]),
            "parameters": sum(1 for n in every[0] if n in parameters),
            "buffers": sum(1 for n in every[0] if n not in parameters), "diverging": diverging}


def format_sync(result: dict[str, Any], steps: int) -> tuple[bool, list[str]]:
    """(passed, lines) for the sync report; ``result`` is what :func:`check_sync` returned on rank 0."""
    head = (f"sync: {result['parameters']} parameters and {result['buffers']} buffers hashed (SHA-256) "
            f"on each of {result['world_size']} ranks after {steps} step(s)")
    diverging = result["diverging"]
    if not diverging:
        return True, [head, "  every rank holds identical copies of every tensor"]
    first = diverging[0]
    worst = max(first.get("max_abs", [[0, 0.0]]), key=lambda rv: rv[1])
    lines = [head,
             f"  first diverging tensor: {first['name']} ({first['kind']}) on rank {first['ranks'][0]}"
             + (f" (and {', '.join(map(str, first['ranks'][1:]))})" if len(first["ranks"]) > 1 else "")
             + f"; largest difference from rank 0: {worst[1]:.3g} (rank {worst[0]})",
             f"  {len(diverging)} of {result['tensors']} tensors differ: "
             + ", ".join(d["name"] for d in diverging[:8]) + (", ..." if len(diverging) > 8 else "")]
    if all(d["kind"] == "buffer" for d in diverging):
        lines.append("  only buffers differ: each rank updates them from its own data (BatchNorm running "
                     "statistics do, unless --sync-batchnorm); the parameters are in sync")
    return False, lines
