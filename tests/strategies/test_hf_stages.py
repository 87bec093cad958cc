"""The pipeline's cut of transformers causal LMs (strategies/hf_stages.py), on one process: the
flat layers compute the model's own logits and gradients, hold every parameter (tied ones
shared), name the cut, and a model the cut cannot express is refused in one line."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from scaleloop.errors import UsageError
from scaleloop.strategies.pipeline import cut_stages, pipeline_layers

transformers = pytest.importorskip("transformers", reason="needs transformers (a test extra)")

VOCAB, SEQ = 96, 12
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=1, pad_token_id=None)


def llama(attn: str = "sdpa") -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, attn_implementation=attn))


def mistral() -> nn.Module:
    # A window shorter than the sequence: every layer's sliding mask matters.
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=4))


def qwen2() -> nn.Module:
    # Layers 0-1 full attention, 2-3 sliding (the config's layer_types).
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4,
                                                                  max_window_layers=2))


def qwen3() -> nn.Module:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SMALL, head_dim=8))


def gpt2(dropout: float = 0.0) -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4,
                                                                n_head=2, resid_pdrop=dropout, embd_pdrop=dropout,
                                                                attn_pdrop=dropout, bos_token_id=0, eos_token_id=1))


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": llama, "llama-eager": lambda: llama("eager"),
                                              "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gpt2": gpt2}


def _run(layers: list[nn.Module], ids: torch.Tensor) -> torch.Tensor:
    x = ids
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("name", MODELS)
def test_flat_layers_compute_the_models_logits_and_gradients(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    ids = torch.randint(0, VOCAB, (3, SEQ))
    target = torch.randint(0, VOCAB, (3, SEQ))
    layers = pipeline_layers(model)

    own = model(ids).logits
    torch.nn.functional.cross_entropy(own.flatten(0, 1), target.flatten()).backward()
    own_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    flat = _run(layers, ids)
    torch.nn.functional.cross_entropy(flat.flatten(0, 1), target.flatten()).backward()

    assert torch.equal(flat, own), f"{name}: {(flat - own).abs().max().item():.2e} apart"   # the same ops
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, own_grads[n], rtol=0, atol=1e-6 * own_grads[n].abs().max().item()), n


def test_every_parameter_is_in_the_layers_and_gpt2s_tied_head_in_both_ends() -> None:
    for name, make in MODELS.items():
        model = make()
        layers = pipeline_layers(model)
        held = {id(p) for layer in layers for p in layer.parameters()}
        assert held == {id(p) for p in model.parameters()}, name
        # the layers hold the model's own modules: its state_dict names are found by tensor
        assert {id(t) for layer in layers for t in layer.state_dict(keep_vars=True).values()} <= \
            {id(t) for t in model.state_dict(keep_vars=True).values()}, name
    model = gpt2()
    first, last = pipeline_layers(model)[0], pipeline_layers(model)[-1]
    assert model.lm_head.weight is model.transformer.wte.weight   # transformers ties them
    assert any(p is model.lm_head.weight for p in first.parameters())
    assert any(p is model.lm_head.weight for p in last.parameters())


def test_the_cut_is_named_by_the_models_blocks() -> None:
    cut = cut_stages(pipeline_layers(llama()), 2, "LlamaForCausalLM")
    lines = cut.describe()
    assert lines[0].startswith("  stage 0: layers 0-2 (embed_tokens, 2 x LlamaDecoderLayer), "), lines
    assert lines[1].startswith("  stage 1: layers 3-5 (2 x LlamaDecoderLayer, norm + lm_head), "), lines
    assert cut.blocks == (2, 2) and cut.block_name == "LlamaDecoderLayer"
    gpt = cut_stages(pipeline_layers(gpt2()), 3, "GPT2LMHeadModel")
    assert gpt.names[0][0] == "wte + wpe" and gpt.names[-1][-1] == "ln_f + lm_head", gpt.names
    assert sum(gpt.blocks) == 4 and gpt.block_name == "GPT2Block"


def test_dropout_is_where_the_model_has_it() -> None:
    """GPT-2's embedding and block dropout run in the flat layers: same masks from the same seed."""
    model = gpt2(dropout=0.3)
    model.train()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    torch.manual_seed(5)
    own = model(ids).logits
    torch.manual_seed(5)
    flat = _run(pipeline_layers(model), ids)
    assert torch.equal(own, flat)


def test_what_the_cut_cannot_express_is_refused_in_one_line() -> None:
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(UsageError, match="decoder-only causal LMs .*BertForSequenceClassification is not one"):
        pipeline_layers(bert)

    class OwnForward(transformers.GPT2LMHeadModel):
        def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return super().forward(*args, **kwargs)

    with pytest.raises(UsageError, match="OwnForward overrides GPT2LMHeadModel.forward"):
        pipeline_layers(OwnForward(gpt2().config))
    # A causal LM of a family whose forward the cut does not follow (Gemma scales its embeddings).
    gemma = transformers.GemmaForCausalLM(transformers.GemmaConfig(**{**SMALL, "head_dim": 8}))
    with pytest.raises(UsageError, match="GemmaForCausalLM is not among them; use --strategy fsdp or ddp"):
        pipeline_layers(gemma)
    # Blocks declared by the user that are not the decoder stack.
    model = llama()
    model.fsdp_blocks = lambda: list(model.model.layers)[:2]   # type: ignore[assignment]
    with pytest.raises(UsageError, match="blocks .* are not the 4 layers its LlamaModel runs") as refused:
        pipeline_layers(model)
    assert "\n" not in str(refused.value)
