"""Step times measured in turns (tools/plan_validate/turns.py) and how validate counts a pair's order:
the rounds are paired, a pair counts as measured only where most rounds agree, and a real
2-process run times each layout once a round."""
from __future__ import annotations

from typing import Any

import pytest

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelSpec

from plan_validate.turns import median_s, pair_agreement, time_in_turns
from plan_validate.validate import concordance, cpu_target, markdown, settled_pairs, share_fabric


def test_a_pairs_agreement_is_the_share_of_rounds_that_order_it_alike() -> None:
    assert pair_agreement([1, 1, 1, 1], [2, 2, 2, 2]) == 1.0
    assert pair_agreement([2, 2, 2, 2], [1, 1, 1, 1]) == 1.0          # either order, if every round says so
    assert pair_agreement([1, 3, 1, 3], [2, 2, 2, 2]) == 0.5
    # Paired by round: a drift that slows both of a pair alike does not blur their order.
    assert pair_agreement([1.0, 5.0, 1.2, 4.0, 9.0], [1.1, 5.5, 1.3, 4.2, 8.0]) == 0.8
    assert median_s([3.0, 1.0, 2.0]) == 2.0


def _row(name: str, predicted: float, rounds: list[float]) -> dict[str, Any]:
    return {"size": "tiny", "layout": name, "measured_peak": 1.0, "predicted_peak": 1.0, "error": 0.0,
            "measured_step_s": median_s(rounds), "predicted_step_s": predicted, "round_s": rounds}


def test_only_the_pairs_the_rounds_settle_count_as_measured() -> None:
    rows = [_row("a", 1.0, [1.0, 1.0, 1.0, 1.0, 1.0]),
            _row("b", 3.0, [2.0, 0.5, 2.0, 0.5, 2.0]),    # against a: 3 of 5 rounds slower, not settled
            _row("c", 2.0, [3.0, 3.0, 3.0, 3.0, 3.0])]    # slower than both in every round
    assert settled_pairs(rows) == [(0, 2), (1, 2)]
    predicted, measured = [r["predicted_step_s"] for r in rows], [r["measured_step_s"] for r in rows]
    # b is predicted slowest but measured in the middle: it is ordered wrong against c (a settled
    # pair) and right against a (not settled).
    assert concordance(predicted, measured) == pytest.approx(2 / 3)
    assert concordance(predicted, measured, settled_pairs(rows)) == 0.5
    report = markdown(rows, "test", 1.0)
    assert "of all 3" in report and "of the 2 pairs that at least 80% of the rounds ordered alike: 50%" in report
    # Rows of runs before the rounds: every pair counts, and the report leaves the line out.
    old = [{k: v for k, v in r.items() if k != "round_s"} for r in rows]
    assert len(settled_pairs(old)) == 3 and "rounds ordered alike" not in markdown(old, "test", 1.0)


def test_every_size_predicts_with_the_median_of_the_fabric_measurements() -> None:
    rows = [{"size": size, "fabric": {"busy_data_s": busy, "small_s": 1.0}} for size, busy in
            (("a", 7.4e-3), ("a", 7.4e-3), ("b", 12.6e-3), ("c", 8.1e-3))]
    share_fabric(rows)
    assert all(r["fabric"]["busy_data_s"] == 8.1e-3 for r in rows)
    assert [r["fabric_measured"]["busy_data_s"] for r in rows] == [7.4e-3, 7.4e-3, 12.6e-3, 8.1e-3]
    share_fabric(rows)   # again (a report re-rendered): from the rows' own measurements, the same
    assert all(r["fabric"]["busy_data_s"] == 8.1e-3 for r in rows)


def test_the_cpu_target_computes_at_the_rate_the_busy_ranks_reached() -> None:
    fabric = {"world_size": 4, "small_s": 1e-4, "small_bytes": 4.0, "grad_s": 5e-3, "grad_bytes": 4.0 * 2**20}
    # Without the busy ranks' rate (runs before it was measured): one process's, shared by 4 on 2 cores.
    old = cpu_target(fabric, 4e9, world=4, cores=2)
    assert (old.fp32_flops, old.host_share) == (2e9, 2.0)
    # With it: that rate, and the host's own work slowed as much as the compute was.
    busy = cpu_target(fabric, 4e9, world=4, cores=2, busy_flops_per_s=1.6e9)
    assert busy.fp32_flops == 1.6e9 and busy.host_share == pytest.approx(2.5)
    assert (old.cores, old.crossed_s_by_ranks, old.crossed_data_s_by_ranks) == (2, (), ())
    # Where the run timed the crossing pairs of a 2-D mesh, its groups of two take those floors
    # (a tensor's less its bytes' time on the fitted link, as the other data floors).
    crossed = cpu_target({**fabric, "busy_cross_s": 2e-3, "busy_cross_data_s": 3e-3, "data_bytes": 65536.0,
                          "busy_pairs_s": 1e-3, "busy_pairs_data_s": 2e-3}, 4e9, world=4, cores=2)
    assert crossed.least_s(2, data=False, crossed=True) == 2e-3 and crossed.least_s(2, data=False) == 1e-3
    assert 2e-3 < crossed.least_s(2, crossed=True) < 3e-3 and crossed.least_s(2) < 2e-3


@pytest.mark.distributed
def test_layouts_are_timed_in_turns_on_the_same_processes(time_limit: None) -> None:
    spec = ModelSpec(seq_len=16, vocab_size=32, d_model=16, n_layers=2, n_heads=2)
    layouts = [Layout("dp", dp=2), Layout("fsdp", fsdp=2), Layout("fsdp x tp", tp=2)]
    times = time_in_turns(spec, layouts, batch_size=4, rounds=3, timeout_s=60)
    assert len(times) == 3 and all(len(t) == 3 and all(0 < s < 60 for s in t) for t in times)
    with pytest.raises(ValueError, match="ranks"):
        time_in_turns(spec, [Layout("dp", dp=2), Layout("fsdp", fsdp=4)], batch_size=4)
