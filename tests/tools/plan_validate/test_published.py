"""The memory model against published figures (tools/plan_validate/published.py): ZeRO's Figure 1,
torchtitan's FSDP runs on 8 and 128 GPUs, Megatron's equation 1, each within the error that
docs/planning.md states."""
from __future__ import annotations

import pytest

from scaleloop.plan.profile import ModelSpec, profile_model

from plan_validate.published import LLAMA31_8B, megatron_layer_bytes, torchtitan_checks, traced_layer_bytes, zero_checks


def test_model_states_match_zero_figure_1() -> None:
    for published, ours in zero_checks():
        assert abs(ours / published.value - 1) <= 0.02, (published.what, ours)


def test_fsdp_model_states_match_torchtitans_8_and_128_gpu_runs() -> None:
    assert LLAMA31_8B == 8_030_261_248   # Meta's count for Llama 3.1 8B
    checks = torchtitan_checks()
    assert len(checks) == 3
    for published, ours in checks:
        # docs/planning.md states this error: within 10% (the plan: 14.0 GiB; torchtitan: 15.0-15.4 GiB)
        assert abs(ours / published.value - 1) <= 0.10, (published.what, ours / 2**30)


def test_a_traced_gpt_layer_keeps_megatrons_activations_without_its_dropout_masks() -> None:
    spec = ModelSpec(seq_len=128, vocab_size=256, d_model=128, n_layers=2, n_heads=4)
    traced = traced_layer_bytes(profile_model(spec, low_precision=True))
    # Equation 1's 34 s*b*h, less the two dropout masks (s*b*h each) that dropout 0 does not keep.
    paper = megatron_layer_bytes(128, 1, 128, 4)
    assert traced == pytest.approx(paper * 32 / 34, rel=0.02)
