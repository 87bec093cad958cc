"""The machines a plan is for: GPU memory, speed and links (datasheet figures; assumptions, stated).

``--gpu h100|h200|a100`` names one of :data:`GPUS`; ``--gpu 48`` (a number) an unnamed GPU of that
many GB, given an H100's speed and links. Inside a node the GPUs talk over NVLink, between nodes
over InfiniBand NDR (the links of :mod:`scaleloop.bench.costmodel`); the host over PCIe.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from scaleloop.bench.costmodel import INTERCONNECTS, Interconnect
from scaleloop.errors import UsageError


@dataclass(frozen=True)
class Target:
    """One kind of GPU in a cluster of ``nodes`` machines with ``per_node`` GPUs each."""

    key: str
    name: str
    memory_bytes: float
    peak_flops: float          # dense bf16 (fp32 runs use the TF32 figure: half of it)
    inside: Interconnect       # between the GPUs of one node
    between: Interconnect      # between nodes
    host_Bps: float            # GPU <-> host memory (PCIe), one direction
    host_adam_Bps: float       # memory bandwidth an offloaded optimizer step gets on the host, per GPU
    per_node: int = 8
    nodes: int = 1
    foreach_optimizer: bool = True   # the optimizer steps in lists (torch's default on CUDA): one fp32 temporary
    usable: float = 0.9              # of the memory, what tensors may take (the CUDA context, fragmentation)

    fp32_flops: float = 0.0          # peak FLOP/s in fp32 (0: half the bf16 peak, as TF32)
    #: Whether communication can run beside the compute (GPUs: its own engines and links); False on
    #: a CPU, whose Gloo threads take the same cores as the compute: nothing hides there.
    overlaps: bool = True
    #: Latency per ring step of a small all-reduce on the host's Gloo group (scaleloop's own
    #: agreement between FSDP's ranks, strategies/fsdp_agreement.py): TCP between processes, an assumption.
    host_latency_s: float = 30e-6
    #: The least one collective costs inside a step, however small (0: its ring latency). On a CPU
    #: with more ranks than cores it waits for its peers to be scheduled again: measured there.
    collective_s: float = 0.0
    #: The same measured for groups of a given size, ((ranks, seconds), ...), where it differs
    #: from ``collective_s`` (on a CPU a pair waits for fewer peers than the whole group).
    collective_s_by_ranks: tuple[tuple[int, float], ...] = ()
    #: The least a collective that carries a tensor costs, by group size, where measured (on a CPU
    #: with more ranks than cores every step of its ring waits for a peer: more than a 1-float
    #: sum, whose empty steps Gloo skips); otherwise what ``collective_s_by_ranks`` gives.
    data_collective_s_by_ranks: tuple[tuple[int, float], ...] = ()
    #: How much slower the host's own work runs than in one process alone: on a CPU with more
    #: ranks than cores, ranks per core (plan.hostwork measures it in one process).
    host_share: float = 1.0
    #: The same two floors measured for groups of a 2-D mesh, whose groups cross (a rank sums
    #: with its row's peers, then with its column's): a late rank holds up both, and the wait
    #: spreads over the mesh; an isolated group waits for its own members only.
    crossed_s_by_ranks: tuple[tuple[int, float], ...] = ()
    crossed_data_s_by_ranks: tuple[tuple[int, float], ...] = ()
    #: Cores the ranks share (0: each rank has a device of its own, as on GPUs). Where the ranks
    #: outnumber them, a rank that waits hands its core to another (a pipeline's bubble).
    cores: int = 0

    def flops(self, precision: str) -> float:
        """The peak FLOP/s a run in ``precision`` divides by."""
        if precision in ("bf16", "fp16"):
            return self.peak_flops
        return self.fp32_flops or self.peak_flops / 2

    def least_s(self, ranks: int, data: bool = True, crossed: bool = False) -> float:
        """The least one collective over ``ranks`` ranks costs inside a step; ``data``: one that
        carries a tensor (False: a few numbers, scaleloop's own agreements); ``crossed``: a group
        of a 2-D mesh (where measured for its size; otherwise as an isolated group's)."""
        if crossed:
            measured = dict(self.crossed_data_s_by_ranks if data else self.crossed_s_by_ranks).get(ranks)
            if measured is not None:
                return measured
        measured = dict(self.data_collective_s_by_ranks).get(ranks) if data else None
        return measured if measured is not None else dict(self.collective_s_by_ranks).get(ranks, self.collective_s)

    @property
    def gpus(self) -> int:
        return self.per_node * self.nodes

    def link(self, ranks: int, spans_nodes: bool) -> Interconnect:
        """The slowest link a group of ``ranks`` crosses."""
        return self.between if spans_nodes and ranks > 1 else self.inside


_LINKS = {link.key: link for link in INTERCONNECTS}
GB = 1e9
#: H100 SXM 80 GB, H200 141 GB, A100 SXM 80 GB; NVLink 4 (A100: NVLink 3, 300 GB/s a direction).
GPUS: dict[str, Target] = {
    "h100": Target("h100", "NVIDIA H100 SXM 80 GB", 80 * GB, 989e12, _LINKS["nvlink"], _LINKS["ib-ndr"],
                   55e9, 25e9),
    "h200": Target("h200", "NVIDIA H200 141 GB", 141 * GB, 989e12, _LINKS["nvlink"], _LINKS["ib-ndr"], 55e9, 25e9),
    "a100": Target("a100", "NVIDIA A100 SXM 80 GB", 80 * GB, 312e12,
                   replace(_LINKS["nvlink"], key="nvlink3", name="NVLink 3", bandwidth_Bps=300e9),
                   replace(_LINKS["ib-ndr"], key="ib-hdr", name="InfiniBand HDR", bandwidth_Bps=25e9), 25e9, 25e9),
}


def parse_target(gpu: str, gpus: int, nodes: int) -> Target:
    """``--gpu`` with ``--gpus`` (in all) and ``--nodes``; UsageError (one line) when impossible."""
    if gpus < 1:
        raise UsageError(f"--gpus must be a positive integer, not {gpus}")
    if nodes < 1:
        raise UsageError(f"--nodes must be a positive integer, not {nodes}")
    if gpus % nodes:
        raise UsageError(f"--gpus {gpus} does not split evenly over --nodes {nodes}: give a multiple of {nodes}")
    key = gpu.strip().lower()
    if key in GPUS:
        base = GPUS[key]
    else:
        try:
            size = float(key.removesuffix("gb"))
        except ValueError:
            raise UsageError(f"unknown --gpu {gpu!r}: give one of {', '.join(GPUS)}, or its memory in GB "
                             "(e.g. --gpu 48)") from None
        if not 0 < size < 10_000:
            raise UsageError(f"--gpu {gpu}: the memory must be a positive number of GB")
        base = replace(GPUS["h100"], key=f"{size:g}gb", name=f"a {size:g} GB GPU (H100 speed and links assumed)",
                       memory_bytes=size * GB)
    return replace(base, per_node=gpus // nodes, nodes=nodes)
