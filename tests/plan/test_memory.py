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

