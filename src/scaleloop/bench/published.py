"""The cost model against a published scaling result, with its error stated.

The reference is the "Results and Benchmarks" table of the guide "Scaling Deep Learning with
PyTorch" (one of the sources this project was written from): images/s and scaling efficiency
of data-parallel training on 1, 4, 8 and 16 GPUs at 32 images per GPU. The table does not name
its model or hardware, so the check states what it assumes: a ResNet-50 (25.6 M parameters:
102 MB of fp32 gradients, DDP's 25 MiB buckets), 8 GPUs per node, and two fabrics - NVLink
inside a node with InfiniBand NDR between nodes, and 100 GbE everywhere. The 1-GPU step time is
the table's own (32 images at 100 images/s).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scaleloop.bench import costmodel


@dataclass(frozen=True)
class PublishedScaling:
    """A published weak-scaling table: (GPUs, images/s, efficiency) at a fixed per-GPU batch."""

    source: str
    per_gpu_batch: int
    rows: tuple[tuple[int, float, float], ...]
    parameters: int
    assumption: str


SEED_002 = PublishedScaling(
    source="the guide 'Scaling Deep Learning with PyTorch', its Results and Benchmarks table",
    per_gpu_batch=32,
    rows=((1, 100.0, 1.00), (4, 380.0, 0.95), (8, 750.0, 0.94), (16, 1450.0, 0.91)),
    parameters=25_557_032,
    assumption="model not named: assumed ResNet-50 (25.6 M parameters, fp32 gradients); 8 GPUs per node",
)

#: (label, interconnect inside a node, interconnect between nodes)
FABRICS: tuple[tuple[str, str, str], ...] = (("NVLink + InfiniBand NDR", "nvlink", "ib-ndr"),
                                             ("100 GbE", "100gbe", "100gbe"))
GPUS_PER_NODE = 8


def check_published(ref: PublishedScaling = SEED_002) -> list[dict[str, Any]]:
    """The model's efficiency at each of the table's GPU counts, per assumed fabric, and its error.

    The ring's slowest link sets its time: NVLink while every GPU is in one node, the network
    beyond. Error = model - published efficiency, in points.
    """
    links = {link.key: link for link in costmodel.INTERCONNECTS}
    step_1 = ref.per_gpu_batch / ref.rows[0][1]
    compute = costmodel.StepCompute(0.0, step_1 / 3, 2 * step_1 / 3, 0.0)
    nbytes = 4.0 * ref.parameters
    buckets = costmodel.buckets_for(nbytes)
    out = []
    for label, inside, between in FABRICS:
        for gpus, _rate, published in ref.rows[1:]:
            link = links[inside if gpus <= GPUS_PER_NODE else between]
            comm = costmodel.ring_allreduce_s(gpus, nbytes, link.bandwidth_Bps, link.latency_s, buckets)
            row: dict[str, Any] = {"fabric": label, "gpus": gpus, "published_efficiency": published,
                                   "comm_s": comm}
            for mode, overlap in (("no_overlap", False), ("overlap", True)):
                eff = compute.total_s / costmodel.step_time_s(compute, comm, overlap)
                row[f"model_{mode}"] = eff
                row[f"error_{mode}"] = eff - published
            out.append(row)
    return out


def worst_error(rows: list[dict[str, Any]]) -> float:
    """The largest |model - published| over every row and both overlap modes, in points (0.09 = 9)."""
    return max(abs(r[f"error_{m}"]) for r in rows for m in ("no_overlap", "overlap"))
