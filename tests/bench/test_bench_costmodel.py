"""The ring all-reduce cost model: the formula, the fit to measured all-reduces, the projection."""
from __future__ import annotations

import math

import pytest

from scaleloop.bench import costmodel
from scaleloop.bench.costmodel import Fabric, StepCompute, ring_allreduce_s


def test_ring_allreduce_formula() -> None:
    assert ring_allreduce_s(1, 1e9, 1e9, 1e-3) == 0.0   # one worker: nothing to reduce
    # 2 workers: each byte crosses 2(N-1)/N = 1 link; 2(N-1) = 2 latency terms.
    assert ring_allreduce_s(2, 1e9, 1e9, 1e-3) == pytest.approx(1.0 + 2e-3)
    # Many workers: the bandwidth term tends to 2 x bytes / bandwidth; latency grows linearly.
    assert ring_allreduce_s(1024, 1e9, 1e9, 0.0) == pytest.approx(2 * 1023 / 1024)
    assert ring_allreduce_s(4, 0.0, 1e9, 1e-6, buckets=3) == pytest.approx(6 * 1e-6 * 3)


def test_overlap_hides_communication_behind_backward_only() -> None:
    c = StepCompute(data_s=0.001, forward_s=0.01, backward_s=0.02, optimizer_s=0.005)
    assert costmodel.step_time_s(c, 0.015, overlap=False) == pytest.approx(c.total_s + 0.015)
    assert costmodel.step_time_s(c, 0.015, overlap=True) == pytest.approx(c.total_s)
    assert costmodel.step_time_s(c, 0.05, overlap=True) == pytest.approx(c.total_s - 0.02 + 0.05)


def test_fit_fabric_recovers_latency_and_bandwidth() -> None:
    n, latency, bandwidth, size = 4, 20e-6, 3e9, 64e6
    bench = {"world_size": n, "small_bytes": 4, "grad_bytes": size,
             "small_s": ring_allreduce_s(n, 4, bandwidth, latency),
             "grad_s": ring_allreduce_s(n, size, bandwidth, latency)}
    fabric = costmodel.fit_fabric(bench)
    assert fabric.latency_s == pytest.approx(latency, rel=1e-3)
    assert fabric.bandwidth_Bps == pytest.approx(bandwidth, rel=1e-3)
    with pytest.raises(ValueError):
        costmodel.fit_fabric(dict(bench, world_size=1))


def _point(workers: int, per_worker: int, step_s: float, comm: float, base_rate: float) -> dict:
    rate = workers * per_worker / step_s
    return {"workers": workers, "per_worker_batch": per_worker, "samples_per_s": rate,
            "efficiency": rate / (workers * base_rate),
            "breakdown": {"data_s": 0.0, "forward_s": 0.01, "backward_s": 0.02, "optimizer_s": step_s - 0.03 - comm},
            "comm": {"grad_bytes": 8e6, "buckets_per_step": 1}}


def test_model_check_is_exact_when_the_world_follows_the_model() -> None:
    fabric = Fabric(bandwidth_Bps=1e9, latency_s=1e-4, fitted_at_workers=2)
    compute = 0.05
    comm2 = fabric.allreduce_s(2, 8e6)
    base = _point(1, 32, compute, 0.0, 32 / compute)
    two = _point(2, 32, compute + comm2, comm2, 32 / compute)
    two["breakdown"] = base["breakdown"]  # unchanged compute: the model's assumption
    [row] = costmodel.check_against_measured([base, two], fabric)
    assert row["error_points_no_overlap"] == pytest.approx(0.0, abs=1e-9)
    assert row["error_rate_no_overlap"] == pytest.approx(0.0, abs=1e-9)
    # Overlap can only predict better efficiency than no overlap.
    assert row["predicted_efficiency_overlap"] >= row["predicted_efficiency_no_overlap"]


def test_projection_falls_with_workers_and_with_slower_links() -> None:
    compute = StepCompute(0.0, 0.01, 0.02, 0.005)
    rows = costmodel.project(compute, nbytes=100e6, buckets=4)
    assert len(rows) == len(costmodel.INTERCONNECTS) * len(costmodel.PROJECTION_WORKERS)
    by_link: dict[str, list[dict]] = {}
    for r in rows:
        by_link.setdefault(r["interconnect"], []).append(r)
        assert 0 < r["efficiency_no_overlap"] <= r["efficiency_overlap"] <= 1.0
    for link_rows in by_link.values():
        effs = [r["efficiency_no_overlap"] for r in link_rows]
        assert effs == sorted(effs, reverse=True)
    # Interconnects are listed fastest first; at every size a slower link is no better.
    keys = [i.key for i in costmodel.INTERCONNECTS]
    for a, b in zip(keys, keys[1:]):
        for ra, rb in zip(by_link[a], by_link[b]):
            assert rb["efficiency_no_overlap"] <= ra["efficiency_no_overlap"]


def test_buckets_default_to_ddp_bucket_size() -> None:
    assert costmodel.buckets_for(1.0) == 1
    assert costmodel.buckets_for(26 * 2**20) == 2
    assert costmodel.buckets_for(1.0, measured=3.0) == 3


def test_strong_scaling_shrinks_batch_work_but_not_the_optimizer() -> None:
    c = StepCompute(0.002, 0.01, 0.02, 0.005).scaled(0.5)
    assert (c.data_s, c.forward_s, c.backward_s, c.optimizer_s) == (0.001, 0.005, 0.01, 0.005)
    assert math.isclose(c.total_s, 0.021)
