"""The memory model's arithmetic on known configurations (against published figures:
tests/tools/plan_validate/test_published.py)."""
from __future__ import annotations

import pytest

from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import Options, estimate, tp_activation_share
from scaleloop.plan.profile import ModelSpec, profile_model

SMALL = ModelSpec(seq_len=32, vocab_size=64, d_model=32, n_layers=4, n_heads=4)


@pytest.fixture(scope="module")
def profile():
    return profile_model(SMALL)


def test_the_profile_counts_parameters_blocks_and_tensor_parallel_layers(profile) -> None:
    d, v, s = 32, 64, 32
    block = 12 * d * d + 13 * d                      # qkv, proj, two MLP layers (+ biases), two norms
    assert profile.block_parameters == (block,) * 4
    assert profile.parameters == 4 * block + v * d + s * d + 2 * d      # tied head, positions, last norm
    # The split Linears: weights, and the biases of the column-wise ones (row-wise biases stay whole).
    assert profile.tp_parameters == 4 * (12 * d * d + 7 * d)
    # Forward and backward: 6 FLOPs per token for each matmul weight (the tied head's too), and
    # the attention's 12 s*s*d per sample and layer (counted by the trace: the counter misses it).
    assert profile.flops_per_sample == 6 * s * (4 * 12 * d * d + v * d) + 12 * s * s * d * 4


def test_replicated_and_sharded_states_follow_the_rules(profile) -> None:
    options = Options(16, "fp32", "adam", foreach_optimizer=False)
    dp, fsdp = estimate(profile, Layout("dp", dp=4), options), estimate(profile, Layout("fsdp", fsdp=4), options)
    p = profile.parameters
    assert dp.parameters == 4 * p and dp.optimizer == 8 * p and dp.buffers == 4 * p   # DDP's buckets
    assert fsdp.parameters == p and fsdp.optimizer == 2 * p
    # The same micro-batch, so the same activations; checkpointing keeps fewer.
    assert dp.activations == fsdp.activations
    checkpointed = estimate(profile, Layout("fsdp", fsdp=4, checkpointing=True), options)
    assert checkpointed.activations < 0.6 * fsdp.activations
    # Offloaded, the states live in host memory.
    offloaded = estimate(profile, Layout("fsdp", fsdp=4, offload=True), options)
    assert offloaded.parameters == offloaded.optimizer == 0 and offloaded.host == pytest.approx(4 * p)


def test_tensor_parallel_share_is_megatrons() -> None:
    assert tp_activation_share(1) == 1
    assert tp_activation_share(2) == pytest.approx(22 / 34)
    assert tp_activation_share(8) == pytest.approx(13 / 34)



def test_each_peak_says_its_moment_and_its_parts_add_up(profile) -> None:
    """Issue 52 point 5: ``dp`` showed grads 0.0 and ``dp +ac`` grads 25.3 with nothing saying why."""
    options = Options(16, "bf16", "adam")
    plain = estimate(profile, Layout("dp", dp=4), options)
    # Without checkpointing the activations are highest when the backward begins: no gradient yet.
    assert plain.moment == "backward start" and plain.gradients == 0
    checkpointed = estimate(profile, Layout("dp", dp=4, checkpointing=True), options)
    # Checkpointing keeps so little that the peak comes later in the backward, with gradients made.
    assert checkpointed.moment.startswith("backward") and checkpointed.gradients > 0
    for memory in (plain, checkpointed):
        assert memory.peak == pytest.approx(memory.parameters + memory.gradients + memory.optimizer
                                            + memory.activations + memory.buffers)


def test_the_optimizer_steps_peak_frees_the_activations_and_keeps_ddps_buckets(profile) -> None:
    # One sample a rank: the activations are small next to the optimizer's fp32 temporaries.
    options = Options(4, "fp32", "adam", foreach_optimizer=True)
    p = profile.parameters
    dp = estimate(profile, Layout("dp", dp=4), options)
    assert dp.moment == "optimizer step" and dp.activations == 0
    # Every gradient; DDP's buckets (a second copy, alive from its construction) and the temporaries.
    assert dp.gradients == 4 * p and dp.buffers == pytest.approx(4 * p + 4 * p)


def test_the_table_names_the_moment_and_explains_the_zeros() -> None:
    from scaleloop.plan.planner import plan
    from scaleloop.plan.target import parse_target

    out = plan(SMALL, parse_target("h100", 4, 1), Options(16, "bf16", "adam"))
    head = next(line for line in out.splitlines() if "peak GB" in line)
    assert "peak at" in head
    assert "backward start: the forward's activations all kept, no gradient yet (grads 0.0)" in out
    assert "the columns add up to the peak" in out
