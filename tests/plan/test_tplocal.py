"""One tensor-parallel rank's share of a model, for the trace (scaleloop.plan.tplocal): the
layers its tp_plan names cut to one rank's slices; a plan it cannot cut leaves the model whole."""
from __future__ import annotations

import pytest
from torch import nn

from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import Options, estimate
from scaleloop.plan.profile import ModelSpec, build_meta, profile_model
from scaleloop.plan.tplocal import shrink_to_rank

SPEC = ModelSpec(seq_len=16, vocab_size=64, d_model=32, n_layers=2, n_heads=4)


def test_each_split_layer_keeps_one_ranks_slice() -> None:
    model = build_meta(SPEC)
    assert shrink_to_rank(model, 4)
    block = model.blocks[1]
    assert (block.attn.qkv.in_features, block.attn.qkv.out_features) == (32, 3 * 32 // 4)
    assert (block.attn.proj.in_features, block.attn.proj.out_features) == (32 // 4, 32)
    assert (block.mlp[0].in_features, block.mlp[0].out_features) == (32, 4 * 32 // 4)
    assert (block.mlp[2].in_features, block.mlp[2].out_features) == (4 * 32 // 4, 32)
    assert block.mlp[2].bias.shape == (32,)      # a rowwise layer adds its whole bias on every rank
    assert model.lm_head.weight.shape == (64, 32) and block.ln1.weight.shape == (32,)   # not in the plan: whole


class _Custom(nn.Module):
    def __init__(self, style: object) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8, device="meta")
        self.style = style

    def tp_plan(self, tp: int) -> dict:
        return {"fc": self.style}


@pytest.mark.parametrize("model", [nn.Linear(8, 8, device="meta"), _Custom(object()), _Custom("sequence"),
                                   _Custom("colwise:3")], ids=["no plan", "style object", "unknown", "indivisible"])
def test_a_plan_it_cannot_cut_leaves_the_model_whole(model: nn.Module) -> None:
    before = [tuple(p.shape) for p in model.parameters()]
    assert not shrink_to_rank(model, 2)
    assert [tuple(p.shape) for p in model.parameters()] == before


def test_a_tensor_parallel_estimate_uses_the_ranks_own_trace() -> None:
    profile = profile_model(SPEC)
    local = profile.rank_series(2, checkpointed=False)
    assert local is not None and profile.rank_series(2, checkpointed=False) is local   # traced once
    # One rank of two keeps less than the whole model's step, and more than half of it (the
    # norms, the residual stream and the logits stay whole).
    assert 0.5 * profile.series.peak < local.peak < profile.series.peak
    options = Options(8, "fp32", "adam", foreach_optimizer=False)
    one = estimate(profile, Layout("fsdp x tp", fsdp=2, tp=1), Options(16, "fp32", "adam", foreach_optimizer=False))
    two = estimate(profile, Layout("fsdp x tp", fsdp=1, tp=2), options)
    # Its activations are at most the rank's traced peak for its 8 samples, less than one rank's
    # of the same batch without the split; its buffers hold one sum's output besides FSDP's units.
    assert two.activations <= 8 * local.peak and two.activations < one.activations
    assert two.buffers >= 8 * SPEC.seq_len * SPEC.d_model * 4
