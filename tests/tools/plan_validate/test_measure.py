"""The plan's peak against the CPU allocator's accounting (the profiler) on 2 real Gloo
processes: a tiny fsdp run and a tiny tensor-parallel one with checkpointing, within 10%; and
the tensor-parallel run's peak at most two sums above that of a fake process group, whose
collectives end as they are issued: the frees that Gloo's threads make are counted
(tools/plan_validate/measure.py)."""
from __future__ import annotations

import pytest

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelSpec, profile_model

from plan_validate.measure import measure
from plan_validate.validate import predicted_peak


@pytest.mark.distributed
@pytest.mark.parametrize("layout, d_model", [(Layout("fsdp", fsdp=2), 32),
                                             (Layout("fsdp x tp", tp=2, checkpointing=True), 64)], ids=["fsdp", "tp"])
def test_the_predicted_peak_of_a_tiny_run_is_close(time_limit: None, layout: Layout, d_model: int) -> None:
    spec = ModelSpec(seq_len=32, vocab_size=64, d_model=d_model, n_layers=2, n_heads=4)
    result = measure(spec, layout, batch_size=8, steps=1, warmup=0, timeout_s=60)
    measured = max(result["peaks"])
    predicted = predicted_peak(profile_model(spec), layout, 8)
    assert measured > 0 and len(result["peaks"]) == 2
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)
    if layout.tp > 1:
        # The fake group's peak is the floor. Above it, a real group may briefly hold a finished
        # sum whose last reference Gloo's thread has not yet dropped (3 runs of 15 here held one
        # at the peak, 12 none). Before the allocator counted the frees in every thread, this
        # run's peak read up to 8 sums above the floor, differently every run.
        floor = measure(spec, layout, batch_size=8, group="fake")["peaks"][0]
        one_sum = 8 * spec.seq_len * spec.d_model * 4
        assert all(floor <= peak <= floor + 2 * one_sum for peak in result["peaks"]), (result["peaks"], floor)


def _fabric_of_this_rank() -> dict:
    from plan_validate.measure import _fabric
    from scaleloop.runtime.dist import DistEnv, init_process_group

    env = DistEnv.from_env()
    init_process_group(env, timeout_s=60)
    return _fabric(env)


@pytest.mark.distributed
def test_the_fabric_times_the_crossing_pairs_of_a_2d_mesh(time_limit: None) -> None:
    from scaleloop.launching.spawn import launch

    # 4 ranks: rows {0,1},{2,3} and columns {0,2},{1,3} in turn; 2 ranks have no mesh to cross.
    four, two = launch(_fabric_of_this_rank, 4), launch(_fabric_of_this_rank, 2)
    wanted = {"busy_small_s", "busy_data_s", "busy_pairs_s", "busy_pairs_data_s", "busy_cross_s", "busy_cross_data_s"}
    assert wanted <= set(four) and all(four[k] >= 0 for k in wanted)
    assert "busy_cross_s" not in two and "busy_pairs_s" not in two and two["busy_data_s"] >= 0
