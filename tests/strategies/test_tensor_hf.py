"""Tensor parallelism of a Hugging Face transformers model (strategies/tensor.py): the model's own
plan (``model.tp_plan``, from its config's ``base_model_tp_plan``) where torch's Colwise/Rowwise
styles express it, else one line naming what is missing; never a silent replicate. No process
group needed here; 2 processes training Llama under ``--mesh tp=2`` to 1 process's weights:
tests/distributed/test_thirdparty_models.py ("llama-tp")."""
from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from scaleloop.errors import UsageError
from scaleloop.strategies.tensor import tp_plan_of


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def llama(**changes: Any) -> nn.Module:
    """4 decoder layers, 4 attention heads, 2 key/value heads (as scripts/hfmodels.py's llama_tiny)."""
    t = _transformers()
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=1)
    return t.LlamaForCausalLM(t.LlamaConfig(**{**config, **changes}))


def gpt2() -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=1))


def _kinds(styles: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """Each split module's torch style by class and its input and output layouts, in words."""
    return {name: (type(s).__name__, str(s.input_layouts[0] if isinstance(s.input_layouts, tuple) else s.input_layouts),
                   str(s.output_layouts[0] if isinstance(s.output_layouts, tuple) else s.output_layouts))
            for name, s in styles.items()}


def test_llama_is_split_by_its_own_plan() -> None:
    styles = _kinds(tp_plan_of(llama(), 2))
    # Every layer the wildcards of transformers' plan name, once: 7 Linears in each of 4 layers,
    # the vocabulary-split embedding and the output layer gathered whole.
    assert len(styles) == 4 * 7 + 2, sorted(styles)
    assert styles["model.layers.3.self_attn.q_proj"] == ("ColwiseParallel", "R", "S(-1)")
    assert styles["model.layers.0.self_attn.k_proj"] == styles["model.layers.0.mlp.up_proj"] \
        == styles["model.layers.0.mlp.gate_proj"] == styles["model.layers.0.self_attn.v_proj"] \
        == ("ColwiseParallel", "R", "S(-1)")
    assert styles["model.layers.2.self_attn.o_proj"] == styles["model.layers.2.mlp.down_proj"] \
        == ("RowwiseParallel", "S(-1)", "R")
    # The logits whole on every rank (the loss is computed as on one process).
    assert styles["lm_head"] == ("ColwiseParallel", "R", "R")
    assert styles["model.embed_tokens"] == ("RowwiseParallel", "R", "R")
    assert not any("norm" in name or "rotary" in name for name in styles)


def test_a_model_without_a_plan_is_refused_in_one_line_naming_why() -> None:
    # GPT-2: transformers gives it no plan, and its layers are Conv1D, not the Linear torch splits.
    with pytest.raises(UsageError) as info:
        tp_plan_of(gpt2(), 2)
    said = str(info.value)
    assert "\n" not in said
    assert said.startswith("tensor parallelism (--mesh tp=2) needs the model's plan: GPT2LMHeadModel has none"), said
    assert "no tp_plan() method, and transformers gives it no tensor-parallel plan" in said, said
    assert "Conv1D" in said and "drop tp from --mesh" in said, said


@pytest.mark.parametrize("style", ["sequence_parallel", "local_colwise", "packed_colwise", "moe_tp_experts"])
def test_a_plan_style_torch_cannot_express_is_named(style: str) -> None:
    model = llama()
    # (set past the property's check: older transformers releases named styles this one does not know)
    model._tp_plan = {**model.tp_plan, "model.layers.*.input_layernorm": style}
    with pytest.raises(UsageError) as info:
        tp_plan_of(model, 2)
    said = str(info.value)
    assert "\n" not in said
    assert (f"LlamaForCausalLM's tensor-parallel plan (transformers) splits 'model.layers.0.input_layernorm' "
            f"as {style!r}, which scaleloop cannot express") in said, said


def test_a_colwise_entry_on_a_layer_that_is_not_a_linear_is_refused() -> None:
    model = llama()
    model.tp_plan = {**model.tp_plan, "model.norm": "colwise"}
    with pytest.raises(UsageError, match=r"'model.norm' is a LlamaRMSNorm: 'colwise' splits an nn.Linear"):
        tp_plan_of(model, 2)


@pytest.mark.parametrize("tp, heads", [(3, "4 attention heads"), (4, "2 key/value heads")])
def test_heads_that_do_not_divide_are_refused(tp: int, heads: str) -> None:
    with pytest.raises(UsageError, match=rf"--mesh tp={tp}: LlamaForCausalLM cannot be split {tp} ways: its {heads} "
                                         rf"do not divide by tp={tp}"):
        tp_plan_of(llama(), tp)


def test_tied_weights_are_not_split_apart() -> None:
    # lm_head.weight is the embedding's: split once as lm_head and once as embed_tokens, the
    # two would become two weights that train apart (a run that is no longer the model).
    with pytest.raises(UsageError, match=r"'lm_head.weight' is tied to 'model.embed_tokens.weight'"):
        tp_plan_of(llama(tie_word_embeddings=True), 2)


def test_the_users_tp_plan_method_comes_first() -> None:
    t = _transformers()

    class Mine(t.LlamaForCausalLM):
        def tp_plan(self, tp: int) -> dict[str, str]:   # the user's word over transformers' plan
            return {"model.layers.0.mlp.down_proj": "rowwise"}

    assert list(tp_plan_of(Mine(llama().config), 2)) == ["model.layers.0.mlp.down_proj"]
