"""Why N workers are not N x one: splitting backward at the last all-reduce launch, and the
attribution of lost efficiency to data, compute, communication and idle time (no processes,
no timing: synthetic timestamps)."""
from __future__ import annotations

import pytest

from scaleloop.bench import breakdown as bd
from scaleloop.bench import scaling


def test_split_backward_on_one_clock() -> None:
    # Step 0: rank 0's backward compute ends at 5, rank 1's at 7; both return at 10.
    marks = [[(0.0, 10.0, 5.0)], [(0.0, 10.0, 7.0)]]
    split = bd.split_backward(marks, same_clock=True)
    # rank 0: compute 5, waits 2 for rank 1, then 3 of exposed all-reduce; rank 1: 7, 0, 3.
    assert split == pytest.approx({"backward_compute_s": 6.0, "wait_s": 1.0, "comm_exposed_s": 3.0})
    assert sum(split.values()) == pytest.approx(10.0)          # the parts add up to backward


def test_split_backward_without_a_shared_clock_keeps_the_wait_in_communication() -> None:
    marks = [[(0.0, 10.0, 5.0)], [(100.0, 110.0, 107.0)]]      # clocks of two machines
    split = bd.split_backward(marks, same_clock=False)
    assert split["wait_s"] is None
    assert split["backward_compute_s"] == pytest.approx(6.0)
    assert split["comm_exposed_s"] == pytest.approx(4.0)


def test_split_backward_edge_cases() -> None:
    # A step without an all-reduce is all compute; a launch timestamp is clamped into backward.
    split = bd.split_backward([[(0.0, 4.0, None), (10.0, 12.0, 13.0)]], same_clock=True)
    assert split["backward_compute_s"] == pytest.approx((4.0 + 2.0) / 2)
    assert split["comm_exposed_s"] == pytest.approx(0.0)
    assert bd.split_backward([[]], same_clock=True)["backward_compute_s"] is None


def _point(workers: int, batch: int, elapsed: float, steps: int, **phases: float) -> dict:
    b = {"data_s": 0.001, "forward_s": 0.1, "backward_s": 0.2, "optimizer_s": 0.05,
         "backward_compute_s": 0.2, "wait_s": 0.0, "comm_exposed_s": 0.0}
    b.update(phases)
    b["step_s"] = b["data_s"] + b["forward_s"] + b["backward_s"] + b["optimizer_s"]
    return {"workers": workers, "per_worker_batch": batch, "elapsed_s": elapsed, "steps": steps, "breakdown": b}


def test_attribution_adds_up_to_the_lost_efficiency() -> None:
    base = _point(1, 64, elapsed=10 * 0.352, steps=10)
    two = _point(2, 64, elapsed=10 * 0.40, steps=10, forward_s=0.11, backward_s=0.23, backward_compute_s=0.205,
                 wait_s=0.01, comm_exposed_s=0.015, optimizer_s=0.055)
    a = bd.attribute(base, two)
    assert a["ideal_step_s"] == pytest.approx(0.352) and a["step_s"] == pytest.approx(0.40)
    assert a["efficiency"] == pytest.approx(0.352 / 0.40)
    s = a["seconds"]
    assert s["forward"] == pytest.approx(0.01) and s["backward_compute"] == pytest.approx(0.005)
    assert s["communication"] == pytest.approx(0.015) and s["idle"] == pytest.approx(0.01)
    assert sum(s.values()) == pytest.approx(a["lost_s"])
    assert sum(a["points"].values()) == pytest.approx(1 - a["efficiency"])
    assert sum(a["kinds_points"].values()) == pytest.approx(1 - a["efficiency"])
    assert a["kinds_s"]["compute"] == pytest.approx(0.01 + 0.005 + 0.005)
    assert a["kinds_s"]["idle"] == pytest.approx(s["idle"] + s["between_steps"])
    assert max(a["points"], key=lambda k: a["points"][k]) == "communication"


def test_attribution_in_strong_scaling_expects_the_step_to_shrink() -> None:
    base = _point(1, 64, elapsed=0.351, steps=1)
    half = _point(2, 32, elapsed=0.2, steps=1, data_s=0.0005, forward_s=0.05, backward_s=0.1,
                  backward_compute_s=0.1, optimizer_s=0.05)
    a = bd.attribute(base, half)
    assert a["ideal_step_s"] == pytest.approx(0.351 / 2)
    # The optimizer does not shrink with the batch: strong scaling pays for it on every worker.
    assert a["seconds"]["optimizer"] == pytest.approx(0.05 - 0.025)
    assert sum(a["points"].values()) == pytest.approx(1 - a["efficiency"])


def test_attribution_without_a_split_backward() -> None:
    base = _point(1, 64, elapsed=0.351, steps=1)
    two = _point(2, 64, elapsed=0.5, steps=1, backward_s=0.3, backward_compute_s=None, wait_s=None,
                 comm_exposed_s=None)
    a = bd.attribute(base, two)
    assert not a["backward_split"]
    assert a["seconds"]["communication"] is None and a["seconds"]["idle"] is None
    assert a["seconds"]["backward_compute"] == pytest.approx(0.1)
    assert sum(v for v in a["points"].values() if v is not None) == pytest.approx(1 - a["efficiency"])


def _run(workers: int, rate: float, rep: int) -> dict:
    p = _point(workers, 64, elapsed=64 * workers * 10 / rate, steps=10)
    p.update(samples_per_s=rate, repetition=rep, load_1m=0.1)
    return p


def test_point_is_the_median_repetition_with_its_spread() -> None:
    base = [_run(1, 100.0, 1), _run(1, 110.0, 2), _run(1, 90.0, 3)]
    two = [_run(2, 190.0, 1), _run(2, 150.0, 2), _run(2, 170.0, 3)]
    p = scaling._point(2, two, base)
    assert p["samples_per_s"] == 170.0 and p["repetition"] == 3          # the median run, as measured
    assert p["samples_per_s_min"] == 150.0 and p["samples_per_s_max"] == 190.0
    assert p["efficiency"] == pytest.approx(170.0 / (2 * 100.0))         # median over median
    # Per repetition, against the 1-worker run of the same repetition (side by side).
    effs = [r["efficiency"] for r in p["repetitions"]]
    assert effs == pytest.approx([190 / 200, 150 / 220, 170 / 180])
    assert p["efficiency_min"] == pytest.approx(min(effs)) and p["efficiency_max"] == pytest.approx(max(effs))
    # An even count takes the lower middle run: a real measurement, never an average of two.
    assert scaling._point(1, base[:2], base[:2])["samples_per_s"] == 100.0


def test_target_note_says_met_or_not_and_why() -> None:
    base = _run(1, 100.0, 1)
    base_point = scaling._point(1, [base], [base])
    good = scaling._point(2, [_run(2, 190.0, 1)], [base])
    slow = _point(2, 64, elapsed=0.5, steps=1, comm_exposed_s=0.1, backward_s=0.3)
    bad = dict(scaling._point(2, [_run(2, 120.0, 1)], [base]), **{k: slow[k] for k in ("elapsed_s", "steps", "breakdown")})
    [note] = bd.target_notes(0.9, [base_point, good], [bd.attribute(base_point, good)])
    assert "0.90 at 2 workers: met (median 0.95)" in note
    [note] = bd.target_notes(0.9, [base_point, bad], [bd.attribute(base_point, bad)])
    assert "NOT met" in note and "all-reduce not hidden by backward" in note
    assert bd.target_notes(None, [base_point, good], []) == []


def test_attribution_table_renders() -> None:
    base = _point(1, 64, elapsed=0.352, steps=1)
    two = _point(2, 64, elapsed=0.4, steps=1, comm_exposed_s=0.03, backward_s=0.23)
    table = bd.table([bd.attribute(base, two)])
    md = table.markdown()
    assert "| workers | ideal step ms | measured step ms |" in md
    assert "communication ms (points)" in md and "+30.00 (+7.5)" in md


def test_compute_off_the_core_is_wall_minus_cpu_time() -> None:
    # 1 worker: compute 0.35 s wall, all of it on the core; 2 workers: 0.45 s wall, 0.38 s CPU.
    base = _point(1, 64, elapsed=0.351, steps=1, compute_cpu_s=0.35)
    two = _point(2, 64, elapsed=0.5, steps=1, forward_s=0.15, backward_s=0.25, backward_compute_s=0.25,
                 compute_cpu_s=0.38)
    a = bd.attribute(base, two)
    assert a["kinds_s"]["compute"] == pytest.approx(0.10)
    assert a["compute_off_core_s"] == pytest.approx(0.07)            # of those 0.10 s, 0.07 s off the core
    assert a["compute_off_core_points"] == pytest.approx(0.07 / 0.5)
    [note] = bd.target_notes(0.9, [dict(base, repetitions=[{}]),
                                   dict(two, efficiency=0.7, repetitions=[{}])], [a])
    assert "off its core" in note
    assert "of compute: thread off its core" in bd.table([a]).markdown()
    # Without CPU times (CUDA, FSDP) there is no such split.
    assert bd.attribute(_point(1, 64, 0.351, 1), _point(2, 64, 0.5, 1))["compute_off_core_s"] is None
