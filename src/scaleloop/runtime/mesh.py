"""One way to say how ranks are laid out: a device mesh with named dimensions.

``--mesh dp=2,tp=2`` (or ``MeshSpec.parse("dp=2,tp=2")``) names the size of each dimension:

- ``dp``: data parallel, replicated: each replica holds the whole (tensor-parallel) model;
- ``fsdp`` (alias ``shard``): data parallel, sharded: each rank holds 1/``fsdp`` of every parameter;
- ``tp``: tensor parallel: each layer that the model's ``tp_plan()`` names is split over these ranks;
- ``pp``: pipeline stages; with ``dp`` only (pipeline x data parallel), run by the pipeline
  strategy with each stage replicated ``dp`` times (docs/strategies.md).

Ranks are laid out row-major in the order ``pp, dp, fsdp, tp`` (torchtitan's order: the
dimension that communicates most, ``tp``, is innermost, so its ranks are neighbours on one
machine). The product of the sizes must be the job's world size. Omitted dimensions have size 1.

Parsing, checking and drawing import no torch (the CLI validates a config before any worker
starts); :meth:`MeshSpec.build` makes the ``torch.distributed`` ``DeviceMesh``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scaleloop.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

#: Dimension names, outermost first (the rank layout's order).
DIMS = ("pp", "dp", "fsdp", "tp")
ALIASES = {"shard": "fsdp", "replicate": "dp"}
_WHAT = {"pp": "pipeline stage", "dp": "data replica", "fsdp": "data shard", "tp": "tensor slice"}
_HELP = "dp (replicate), fsdp or shard (shard), tp (tensor parallel), pp (pipeline)"


@dataclass(frozen=True)
class MeshSpec:
    """Sizes of the named mesh dimensions (1 where not given); see the module docstring."""

    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    tp: int = 1

    # --- reading and checking -------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """``"dp=2,tp=2"`` -> ``MeshSpec(dp=2, tp=2)``; UsageError (one line) for anything else."""
        sizes: dict[str, int] = {}
        items = [item.strip() for item in text.split(",")]
        if not text.strip() or any(not item for item in items):
            raise UsageError(f"--mesh {text!r}: give NAME=SIZE pairs separated by commas, e.g. --mesh dp=2,tp=2")
        for item in items:
            match = re.fullmatch(r"([A-Za-z_]+)\s*=\s*(-?\d+)", item)
            if match is None:
                raise UsageError(f"--mesh {text!r}: {item!r} is not NAME=SIZE (e.g. tp=2); names: {_HELP}")
            name, size = match.group(1).lower(), int(match.group(2))
            name = ALIASES.get(name, name)
            if name not in DIMS:
                raise UsageError(f"--mesh {text!r}: unknown dimension {match.group(1)!r}; use {_HELP}")
            if name in sizes:
                raise UsageError(f"--mesh {text!r}: dimension {name} is given twice")
            if size < 1:
                raise UsageError(f"--mesh {text!r}: {name} must be a positive integer, not {size}")
            sizes[name] = size
        return cls(**sizes)

    @property
    def world_size(self) -> int:
        """Ranks the mesh has: the product of its sizes."""
        return math.prod(self.sizes.values())

    @property
    def sizes(self) -> dict[str, int]:
        """Every dimension's size, outermost first (size 1 included)."""
        return {name: getattr(self, name) for name in DIMS}

    @property
    def data_parallel(self) -> int:
        """Ranks that train on different samples: ``dp x fsdp`` (tp and pp ranks share a batch)."""
        return self.dp * self.fsdp

    def check(self, world_size: int) -> "MeshSpec":
        """UsageError unless the mesh has exactly ``world_size`` ranks; returns itself."""
        if self.world_size != world_size:
            raise UsageError(f"--mesh {self} has {self.world_size} ranks, but the job has {world_size} processes: "
                             f"make --nproc x --nnodes {self.world_size}, or change the mesh")
        return self

    def __str__(self) -> str:
        given = [f"{name}={size}" for name, size in self.sizes.items() if size > 1]
        return ",".join(given) or "dp=1"

    # --- where each rank sits ---------------------------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dimension (row-major in ``DIMS`` order)."""
        coords: dict[str, int] = {}
        for name in reversed(DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in DIMS}

    def data_rank(self, rank: int) -> int:
        """Which of the :attr:`data_parallel` shares of each batch ``rank`` trains on."""
        c = self.coordinates(rank)
        return c["dp"] * self.fsdp + c["fsdp"]

    def draw(self) -> list[str]:
        """The layout as text: a grid of ranks (rows: the outer dimensions; columns: the innermost
        one larger than 1), then what each rank holds."""
        used = [name for name in DIMS if getattr(self, name) > 1] or ["dp"]
        inner, outer = used[-1], used[:-1]
        size = getattr(self, inner)
        lines = [f"mesh {' x '.join(f'{n}={getattr(self, n)}' for n in used)} ({self.world_size} ranks, "
                 f"{' > '.join(used)}: outermost first)"]
        label_w = len(self._row_label(0, outer))
        cell = len(f"{inner}={size - 1}") + 2
        lines.append((" " * (label_w + 4) + "".join(f"{inner}={i}".ljust(cell) for i in range(size))).rstrip())
        for row in range(self.world_size // size):
            ranks = [row * size + i for i in range(size)]
            cells = "".join(f"r{r}".ljust(cell) for r in ranks)
            lines.append(f"  {self._row_label(ranks[0], outer):<{label_w}}  {cells}".rstrip())
        for rank in range(self.world_size):
            lines.append(f"  rank {rank}: {self.holds(rank)}")
        return lines

    def _row_label(self, rank: int, outer: list[str]) -> str:
        c = self.coordinates(rank)
        return " ".join(f"{n}={c[n]}" for n in outer)

    def holds(self, rank: int) -> str:
        """What ``rank`` holds and trains on, in words."""
        c = self.coordinates(rank)
        parts = []
        if self.pp > 1:
            parts.append(f"stage {c['pp']} of {self.pp}")
        if self.tp > 1:
            parts.append(f"tensor slice {c['tp']} of {self.tp} of each layer in tp_plan()")
        if self.fsdp > 1:
            parts.append(f"shard {c['fsdp']} of {self.fsdp} of every parameter")
        if self.dp > 1:
            parts.append(f"in replica {c['dp']} of {self.dp}")
        weights = ", ".join(parts) or "the whole model"
        return f"batch share {self.data_rank(rank)} of {self.data_parallel}; weights: {weights}"

    # --- the torch mesh -------------------------------------------------------------------
    def build(self, device_type: str, dims: tuple[str, ...] = DIMS, *, timeout: "timedelta") -> "DeviceMesh":
        """The ``DeviceMesh`` over all ranks with the dimensions ``dims`` named, outermost first
        (by default every one, size-1 ones too, so that ``mesh["dp", "fsdp"]`` exists in every
        layout; the others must have size 1). ``timeout`` bounds each collective on the mesh's
        groups (``--timeout``). A collective: every rank calls it."""
        from torch.distributed.device_mesh import init_device_mesh

        names = tuple(d for d in DIMS if d in dims)
        sizes = tuple(self.sizes[d] for d in names)
        return init_device_mesh(device_type, sizes, mesh_dim_names=names,
                                backend_override=_timed_groups(dict(zip(names, sizes)), timeout))


def _timed_groups(sizes: dict[str, int], timeout: "timedelta") -> dict[str, Any]:
    """``init_device_mesh``'s ``backend_override``: for each dimension that gets groups of its
    own, options that carry ``timeout``. It has no timeout argument, and makes each dimension's
    groups with torch's 30-minute default unless the options name one (torch 2.13,
    ``device_mesh._init_one_process_group``). A dimension over every rank is left out: torch then
    reuses the default group, whose timeout is already ``--timeout``, and makes no other (except
    with Gloo where CUDA is present: that group is made, so it gets the options too). Only Gloo
    and NCCL wait; another backend (the plan's fake group) gets no options, which it would refuse."""
    import torch
    import torch.distributed as torch_dist
    from torch._C._distributed_c10d import Backend

    backend = torch_dist.get_backend()
    world = torch_dist.get_world_size()
    made_anew = torch.cuda.is_available() and backend == "gloo"
    override: dict[str, Any] = {}
    for name, size in sizes.items():
        if (size == world and not made_anew) or backend not in ("gloo", "nccl"):
            continue
        if backend == "nccl":
            options = torch_dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False   # as torch's own new NCCL groups
        else:
            options = Backend.Options(backend)
        options._timeout = timeout
        override[name] = options
    return override
