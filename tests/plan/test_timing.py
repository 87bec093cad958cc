"""The time model's arithmetic on known configurations, and the largest batch that fits."""
from __future__ import annotations

import pytest

from scaleloop.bench.costmodel import ring_allreduce_s
from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import Options, estimate
from scaleloop.plan.planner import largest_batch
from scaleloop.plan.profile import ModelSpec, profile_model
from scaleloop.plan.target import parse_target
from scaleloop.plan.timing import compute_s, step_time


@pytest.fixture(scope="module")
def profile():
    return profile_model(ModelSpec(seq_len=32, vocab_size=64, d_model=32, n_layers=4, n_heads=4))


def test_compute_is_flops_over_peak_at_the_mfu(profile) -> None:
    h100 = parse_target("h100", 8, 1)
    options = Options(64, "bf16", "adam")
    expected = profile.flops_per_sample * 64 / 8 / (989e12 * 0.5)
    assert compute_s(profile, Layout("dp", dp=8), options, h100, 0.5) == pytest.approx(expected)
    # Checkpointing adds a forward (a third of forward and backward); tp splits the work.
    assert compute_s(profile, Layout("dp", dp=8, checkpointing=True), options, h100, 0.5) == pytest.approx(expected * 4 / 3)
    assert compute_s(profile, Layout("fsdp x tp", fsdp=4, tp=2), options, h100, 0.5) == pytest.approx(expected)


def test_ddp_adds_the_all_reduce_the_backward_cannot_hide(profile) -> None:
    # A slow link (an unnamed GPU's NVLink made slow) so that the all-reduce outlasts the backward.
    target = parse_target("h100", 8, 2)
    options = Options(8, "bf16", "adam")
    t = step_time(profile, Layout("dp", dp=8), options, target, 0.4)
    comm = ring_allreduce_s(8, profile.parameters * 4, target.between.bandwidth_Bps, target.between.latency_s, 1)
    assert t.total_s == pytest.approx(t.compute_s + max(0.0, comm - t.compute_s * 2 / 3))


def test_a_cpu_hides_nothing_and_fsdp_pays_the_ranks_agreement(profile) -> None:
    from dataclasses import replace

    target = parse_target("h100", 8, 2)
    options = Options(8, "bf16", "adam")
    dp = Layout("dp", dp=8)
    cpu = replace(target, overlaps=False)
    overlapped, serial = step_time(profile, dp, options, target, 0.4), step_time(profile, dp, options, cpu, 0.4)
    comm = ring_allreduce_s(8, profile.parameters * 4, target.between.bandwidth_Bps, target.between.latency_s, 1)
    assert serial.total_s == pytest.approx(serial.compute_s + comm)       # the all-reduce hides behind nothing
    assert overlapped.total_s < serial.total_s
    # FSDP: 3 agreements per unit (its 4 blocks) and 3 per step, each a small ring all-reduce over all ranks.
    fsdp = Layout("fsdp", fsdp=8)
    quiet, chatty = replace(cpu, host_latency_s=0.0), replace(cpu, host_latency_s=1e-3)
    added = step_time(profile, fsdp, options, chatty, 0.4).total_s - step_time(profile, fsdp, options, quiet, 0.4).total_s
    assert added == pytest.approx((3 * 4 + 3) * 2 * 7 * 1e-3)


def test_the_pipeline_pays_its_bubble(profile) -> None:
    target = parse_target("h100", 4, 1)
    options = Options(16, "bf16", "adam")
    # A low MFU, so that the tiny model's compute is above the floor of a GPU step.
    t = step_time(profile, Layout("pp x dp", pp=4, microbatches=8), options, target, 1e-4)
    assert t.compute_s == pytest.approx(compute_s(profile, Layout("pp x dp", pp=4, microbatches=8), options, target, 1e-4)
                                        * (8 + 3) / 8)


def test_on_cores_shared_by_more_ranks_a_waiting_stage_hands_its_core_on(profile) -> None:
    # 4 ranks on 2 cores: two pipelines of 2 stages keep both cores busy through the bubble (at
    # least one stage of each has work); one pipeline of 4 stages leaves one core of two idle.
    from dataclasses import replace

    from scaleloop.plan.timing import bubble

    gpu = parse_target("h100", 4, 1)
    cpu = replace(gpu, overlaps=False, cores=2)
    two, four = Layout("pp x dp", pp=2, dp=2, microbatches=4), Layout("pp x dp", pp=4, microbatches=8)
    assert (bubble(two, gpu), bubble(four, gpu)) == (pytest.approx(1 / 4), pytest.approx(3 / 8))
    assert (bubble(two, cpu), bubble(four, cpu)) == (0.0, pytest.approx(3 / 8 / 2))
    assert bubble(four, replace(cpu, cores=4)) == pytest.approx(3 / 8)   # a core each: nothing to hand on
    options = Options(16, "fp32", "adam")
    assert step_time(profile, two, options, cpu, 1e-4).compute_s == pytest.approx(
        compute_s(profile, two, options, cpu, 1e-4))


def test_a_middle_stage_sends_and_receives_on_both_sides(profile) -> None:
    # Each piece's activation and gradient: a 2-stage pipeline's stages have one neighbour (2
    # transfers a piece), a 4-stage pipeline's middle stages two (4), each at least the floor.
    from dataclasses import replace

    options = Options(16, "fp32", "adam")
    cpu = replace(parse_target("h100", 4, 1), overlaps=False, collective_s_by_ranks=((2, 1e-3),))
    zero = replace(cpu, collective_s_by_ranks=((2, 0.0),))
    added = {}
    for layout in (Layout("pp x dp", pp=2, dp=2, microbatches=8), Layout("pp x dp", pp=4, microbatches=8)):
        added[layout.pp] = step_time(profile, layout, options, cpu, 0.4).comm_s - step_time(profile, layout, options, zero, 0.4).comm_s
    # pp=2,dp=2 also sums its stage's gradients over the 2 replicas once: one all-reduce's floor.
    assert added[2] == pytest.approx(2 * 8 * 1e-3 + 1e-3, rel=0.02) and added[4] == pytest.approx(4 * 8 * 1e-3, rel=0.02)


def test_the_groups_of_a_2d_mesh_wait_as_crossed_groups(profile) -> None:
    # Where the target measured crossing pairs, a 2-D layout's pair collectives take that floor;
    # a 1-D layout's groups, and collectives over every rank, keep their own.
    from dataclasses import replace

    options = Options(8, "fp32", "adam")
    cpu = replace(parse_target("h100", 4, 1), overlaps=False, host_latency_s=0.0, collective_s=2e-3,
                  collective_s_by_ranks=((2, 1e-3),), data_collective_s_by_ranks=((4, 7e-3), (2, 3e-3)))
    crossed = replace(cpu, crossed_s_by_ranks=((2, 1.5e-3),), crossed_data_s_by_ranks=((2, 5e-3),))
    assert (crossed.least_s(2, crossed=True), crossed.least_s(2, data=False, crossed=True)) == (5e-3, 1.5e-3)
    assert (cpu.least_s(2, crossed=True), crossed.least_s(2), crossed.least_s(4, crossed=True)) == (3e-3, 3e-3, 7e-3)
    for flat in (Layout("fsdp", fsdp=4), Layout("fsdp x tp", tp=4), Layout("pp x dp", pp=4, microbatches=8)):
        assert step_time(profile, flat, options, crossed, 0.4).total_s == step_time(profile, flat, options, cpu, 0.4).total_s
    hsdp = Layout("hsdp", dp=2, fsdp=2)
    added = step_time(profile, hsdp, options, crossed, 0.4).total_s - step_time(profile, hsdp, options, cpu, 0.4).total_s
    units = 4 + 1
    # The shards' gathers and reduce-scatters (half a floor each) and the replicas' sums (a whole
    # one each), one per unit; the agreements over all 4 ranks unchanged.
    assert added == pytest.approx((5e-3 - 3e-3) * ((2 * units + units) / 2 + units), rel=0.02)


def test_the_largest_batch_that_fits_is_the_edge(profile) -> None:
    options = Options(1, "fp32", "adam", foreach_optimizer=False)
    layout = Layout("dp", dp=1)
    capacity = estimate(profile, layout, Options(37, "fp32", "adam", foreach_optimizer=False)).peak
    assert largest_batch(profile, layout, options, capacity) == 37
    assert largest_batch(profile, layout, options, 1.0) == 0


def test_each_collective_costs_at_least_the_targets_least(profile) -> None:
    # A CPU with more ranks than cores: every collective waits for its peers to be scheduled,
    # however small it is (Target.collective_s, measured there); GPUs have none (0).
    from dataclasses import replace

    options = Options(8, "fp32", "adam")
    cpu = replace(parse_target("h100", 4, 1), overlaps=False, host_latency_s=0.0)
    slow = replace(cpu, collective_s=5e-3)
    fsdp = Layout("fsdp", fsdp=4)
    added = step_time(profile, fsdp, options, slow, 0.4).total_s - step_time(profile, fsdp, options, cpu, 0.4).total_s
    units = 4 + 1
    # Each all-gather (forward and backward) and reduce-scatter at half of 5 ms (a ring of half an
    # all-reduce's steps), and each of the 3 x 4 + 3 agreements (all-reduces) at 5 ms, instead of
    # their (much smaller) ring latency.
    assert added == pytest.approx(5e-3 / 2 * (2 * units + units) + 5e-3 * (3 * 4 + 3), rel=0.02)
    # hsdp: the same gathers, reduce-scatters and agreements, and each unit's shard summed across
    # the replicas on its own (FSDP's, not DDP's buckets).
    hsdp = Layout("hsdp", dp=2, fsdp=2)
    hsdp_added = step_time(profile, hsdp, options, slow, 0.4).total_s - step_time(profile, hsdp, options, cpu, 0.4).total_s
    assert hsdp_added - added == pytest.approx(5e-3 * units, rel=0.02)
    # Checkpointing runs each unit's forward again, and its agreement with it.
    fsdp_ac = Layout("fsdp", fsdp=4, checkpointing=True)
    assert (step_time(profile, fsdp_ac, options, slow, 0.4).comm_s - step_time(profile, fsdp_ac, options, cpu, 0.4).comm_s
            - added) == pytest.approx(5e-3 * 4, rel=0.02)
    # Tensor parallelism: four sums per block, one more when the forward is recomputed.
    tp, tp_ac = Layout("fsdp x tp", tp=4), Layout("fsdp x tp", tp=4, checkpointing=True)
    sums = [step_time(profile, layout, options, slow, 0.4).comm_s - step_time(profile, layout, options, cpu, 0.4).comm_s
            for layout in (tp, tp_ac)]
    # The recomputed forward: one more sum a block, and one more agreement a block (the mesh
    # strategy agrees on every unit's forward, tensor-parallel only or not).
    assert sums[1] - sums[0] == pytest.approx(5e-3 * 4 + 5e-3 * 4, rel=0.02)


def test_collectives_that_carry_tensors_wait_more_than_the_agreements(profile) -> None:
    # On a CPU with more ranks than cores every step of a ring waits for a peer; a 1-float sum
    # skips its empty steps. FSDP's gathers and reduce-scatters take the data floor; scaleloop's
    # own agreements (a few numbers) keep the small one.
    from dataclasses import replace

    options = Options(8, "fp32", "adam")
    cpu = replace(parse_target("h100", 4, 1), overlaps=False, host_latency_s=0.0, collective_s=2e-3)
    data = replace(cpu, data_collective_s_by_ranks=((4, 7e-3),))
    assert (data.least_s(4), data.least_s(4, data=False), data.least_s(2)) == (7e-3, 2e-3, 2e-3)
    fsdp = Layout("fsdp", fsdp=4)
    added = step_time(profile, fsdp, options, data, 0.4).total_s - step_time(profile, fsdp, options, cpu, 0.4).total_s
    units = 4 + 1
    assert added == pytest.approx((7e-3 - 2e-3) / 2 * (2 * units + units), rel=0.02)
