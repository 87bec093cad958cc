"""``--check sync``: are the replicas still identical? A hash of every parameter and buffer on every rank.

Data parallelism keeps N copies of the model that must stay bit-for-bit equal: every rank
starts from rank 0's weights and applies the same averaged gradient. A copy that drifts
(a buffer updated from local data, a parameter left out of the all-reduce, a rank-dependent
initialisation) trains a different model on that rank without any error. Comparing SHA-256
digests finds it, and the first diverging tensor, in ``state_dict`` order, says where to look.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from scaleloop.runtime.collectives import gather_object
from scaleloop.strategies.base import Strategy
from scaleloop.strategies.pipeline import StageModule
from scaleloop.verify.hashing import digest, full_tensor
from scaleloop.verify.buffers import parameter_names, unique_state


def _tensors(module: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """This rank's tensors by the user's model's ``state_dict`` keys, and which are parameters.

    A pipeline stage (``StageModule``) holds part of the model: its tensors under the whole
    model's keys. FSDP's sharded tensors are gathered whole (a collective: every rank calls this).
    """
    if isinstance(module, StageModule):
        params = {name for local, _ in module.named_parameters() for name in module.global_keys.get(local, ())}
        return module.global_state(), params
    # A tied weight once, under its first name, and as a parameter (never as a buffer).
    return ({name: full_tensor(t.detach()) for name, t in unique_state(module)}, parameter_names(module))


def check_sync(strategy: Strategy, module: nn.Module) -> Optional[dict[str, Any]]:
    """Compare every rank's parameters and buffers; the result on rank 0, None elsewhere.

    A collective: every rank must call it at the same point. The result lists each diverging
    tensor (name, parameter or buffer, the ranks whose copy differs from the first holder's) and,
    for the first one, the largest absolute difference per rank. Data-parallel ranks hold every
    tensor; a pipeline's stages hold different parts, so only the tensors that several stages
    hold (tied weights) have copies to compare (``stages`` in the result says so).
    """
    env = strategy.env
    tensors, parameters = _tensors(module)
    digests = {name: digest(t) for name, t in tensors.items()}
    every = gather_object((digests, sorted(parameters)), env)  # on every rank: all take the same branch below
    parameters = {n for _, names in every for n in names}
    holders: dict[str, list[int]] = {}
    for r, (d, _) in enumerate(every):
        for name in d:
            holders.setdefault(name, []).append(r)
    stages = isinstance(module, StageModule)
    # Data-parallel ranks all hold every tensor; a pipeline's stages share only tied ones.
    shared = [name for name, ranks in holders.items() if len(ranks) > 1 or not stages]
    diverging = []
    for name in shared:
        first, *others = holders[name]
        ranks = [r for r in others if every[r][0][name] != every[first][0][name]]
        if ranks:
            diverging.append({"name": name, "kind": "parameter" if name in parameters else "buffer",
                              "ranks": ranks, "base": first})
    if diverging:
        first = diverging[0]
        t = tensors.get(first["name"])
        copies = gather_object(t.detach().cpu() if t is not None else None, env)
        base = copies[first["base"]].double()
        first["max_abs"] = [[r, float((copies[r].double() - base).abs().max())
                             if copies[r].shape == base.shape else float("inf")] for r in first["ranks"]]
    if env.rank != 0:
        return None
    return {"world_size": len(every), "tensors": len(shared),
            "parameters": sum(1 for n in shared if n in parameters),
            "buffers": sum(1 for n in shared if n not in parameters), "diverging": diverging,
            "stages": stages, "model_tensors": len(holders),
            "replicas": getattr(strategy, "replicas", 1) if stages else 1}


def format_sync(result: dict[str, Any], steps: int) -> tuple[bool, list[str]]:
    """(passed, lines) for the sync report; ``result`` is what :func:`check_sync` returned on rank 0."""
    diverging = result["diverging"]
    if result.get("stages") and result.get("replicas", 1) > 1:
        head = (f"sync: pipeline x {result['replicas']} replicas: of the model's {result['model_tensors']} tensors, "
                f"{result['tensors']} are held by several ranks (each stage's replicas, and tied weights), hashed "
                f"(SHA-256) on each of {result['world_size']} ranks after {steps} step(s)")
        if not diverging:
            return True, [head, "  every rank holding one of them holds an identical copy"]
    elif result.get("stages"):
        head = (f"sync: pipeline: each of {result['world_size']} ranks holds its own stage, so there are no replicas; "
                f"of the model's {result['model_tensors']} tensors, {result['tensors']} are held by several stages "
                f"(tied), hashed (SHA-256) after {steps} step(s)")
        if not result["tensors"]:
            return True, [head, "  nothing to compare"]
        if not diverging:
            return True, [head, "  every stage holding one of them holds an identical copy"]
    else:
        head = (f"sync: {result['parameters']} parameters and {result['buffers']} buffers hashed (SHA-256) "
                f"on each of {result['world_size']} ranks after {steps} step(s)")
        if not diverging:
            return True, [head, "  every rank holds identical copies of every tensor"]
    first = diverging[0]
    worst = max(first.get("max_abs", [[0, 0.0]]), key=lambda rv: rv[1])
    lines = [head,
             f"  first diverging tensor: {first['name']} ({first['kind']}) on rank {first['ranks'][0]}"
             + (f" (and {', '.join(map(str, first['ranks'][1:]))})" if len(first["ranks"]) > 1 else "")
             + f"; largest difference from rank {first.get('base', 0)}: {worst[1]:.3g} (rank {worst[0]})",
             f"  {len(diverging)} of {result['tensors']} tensors differ: "
             + ", ".join(d["name"] for d in diverging[:8]) + (", ..." if len(diverging) > 8 else "")]
    if all(d["kind"] == "buffer" for d in diverging):
        lines.append("  only buffers differ: each rank updates them from its own data (BatchNorm running "
                     "statistics do, unless --sync-batchnorm); the parameters are in sync")
    return False, lines
