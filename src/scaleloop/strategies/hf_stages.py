"""A Hugging Face transformers decoder-only causal LM as the pipeline's flat list of layers.

A transformers causal LM is no ``nn.Sequential``: its base model computes things once for all
its decoder layers (the position ids, the rotary ``position_embeddings``, the causal mask) and
hands them to each. :func:`decoder_layers` cuts it at its blocks (the layers its
``_no_split_modules`` declares, found by ``strategies.blocks.find_blocks``) into layers that each
take and return one tensor, the hidden state, as ``torch.distributed.pipelining`` passes it:

- the embeddings: ``input_ids`` to the first hidden state (the token embedding; GPT-2 adds its
  learned position embedding and applies its embedding dropout);
- one layer per decoder block, which computes from the hidden state's shape what the base
  model would have given it: position ids ``0..T-1``, Llama's rotary ``position_embeddings``
  (by the model's own ``rotary_emb``) and the mask (by transformers' own ``create_causal_mask``
  or ``create_sliding_window_causal_mask``, as the base model picks it for that layer: under
  ``sdpa`` no mask at all, attention is causal by ``is_causal``);
- the final norm and the LM head, giving the logits.

That is the model's forward for what a run calls it with: ``model(input_ids)``, no padding mask,
no KV cache; scaleloop takes the logits and computes the loss. Tested equal to the model's own
forward for every family below (tests/strategies/test_hf_stages.py). The layers hold the
model's own modules, so parameter names, checkpoints, tied weights (GPT-2's ``lm_head.weight``
is ``transformer.wte.weight``: both end stages hold it and the pipeline sums its gradients) and
``save_pretrained`` are the model's.

Only families whose base forward was read are cut (:data:`FAMILIES`, transformers 5); anything
else (an encoder, another family, a subclass with its own ``forward``) is refused in one line
naming what is missing, never cut wrong.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from scaleloop.errors import UsageError

ELSE = "use --strategy fsdp or ddp"


@dataclass(frozen=True)
class Family:
    """What one family's base model does around its decoder layers (its ``forward``, as read)."""

    base: str                   # the base model's class
    tokens: str                 # its token embedding
    stack: str                  # its ModuleList of decoder layers
    norm: str                   # its final norm
    positions: Optional[str] = None   # a learned position embedding, added to the tokens' (GPT-2)
    dropout: Optional[str] = None     # dropout on the first hidden state (GPT-2)
    rotary: bool = False        # the layers take ``position_embeddings`` from ``rotary_emb``
    #: which mask each layer gets: "causal"; "sliding_window" (Mistral: sliding when the config
    #: has a ``sliding_window``); "layer_types" (Qwen2: the config's ``layer_types[i]``)
    masks: str = "causal"
    #: only the first ``config.num_hidden_layers`` of the stack run (Llama's ``layers[:n]``)
    first_n: bool = True


_LLAMA = dict(tokens="embed_tokens", stack="layers", norm="norm", rotary=True)

#: causal-LM class -> its family. The class's own forward is ``lm_head(base(input_ids))`` for each.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(base="LlamaModel", **_LLAMA),
    "MistralForCausalLM": Family(base="MistralModel", masks="sliding_window", **_LLAMA),
    "Qwen2ForCausalLM": Family(base="Qwen2Model", masks="layer_types", **_LLAMA),
    "Qwen3ForCausalLM": Family(base="Qwen3Model", masks="layer_types", **_LLAMA),
    "GPT2LMHeadModel": Family(base="GPT2Model", tokens="wte", positions="wpe", dropout="drop", stack="h",
                              norm="ln_f", first_n=False),
}


def is_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (read from its classes, importing nothing)."""
    return any(cls.__module__.split(".")[0] == "transformers" for cls in type(model).__mro__)


class Embeddings(nn.Module):
    """``input_ids`` to the first hidden state (module docstring)."""

    def __init__(self, tokens: nn.Module, positions: Optional[nn.Module], dropout: Optional[nn.Module],
                 label: str) -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.dropout = dropout
        #: how the pipeline's stage lines name this layer
        self.pipeline_label = label

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.tokens(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(_position_ids(hidden))
        return self.dropout(hidden) if self.dropout is not None else hidden


class DecoderBlock(nn.Module):
    """One decoder layer, given what its base model would compute for it (module docstring)."""

    pipeline_block = True   # counted as a block in the pipeline's first line

    def __init__(self, block: nn.Module, config: Any, mask: Callable[..., Any],
                 rotary: Optional[nn.Module]) -> None:
        super().__init__()
        self.block = block
        # The base model's rotary embedding, shared by every block (it holds no parameters, and
        # its buffers are not saved: the state keeps the model's names).
        self.rotary_emb = rotary
        self.pipeline_label = type(block).__name__
        self._config = config
        self._mask = mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        position_ids = _position_ids(hidden)
        mask = self._mask(config=self._config, inputs_embeds=hidden, attention_mask=None, past_key_values=None,
                          position_ids=position_ids)
        extra = {} if self.rotary_emb is None else {"position_embeddings": self.rotary_emb(hidden, position_ids)}
        out = self.block(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=None,
                         use_cache=False, **extra)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """The final norm and the LM head: the last hidden state to the logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, label: str) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.pipeline_label = label

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))


def _position_ids(hidden: torch.Tensor) -> torch.Tensor:
    """Positions ``0..T-1`` of a ``(batch, T, ...)`` tensor, as ``(1, T)``: what the base model
    uses when given no ``position_ids`` and no cache."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """``model`` (a transformers causal LM of :data:`FAMILIES`) as embeddings, one layer per
    decoder block and the head; UsageError (one line) for a model this cannot express."""
    name = type(model).__name__
    family = _family(model)
    _check_version(name)
    base = _base_model(model, family)
    blocks = _blocks(model, base, family)
    for block in blocks:
        _check_signature(block, family, name)
    masks = [_mask_function(model.config, i, family, name) for i in range(len(blocks))]
    rotary = getattr(base, "rotary_emb", None) if family.rotary else None
    if family.rotary and not isinstance(rotary, nn.Module):
        raise UsageError(f"--strategy pipeline: {name}'s {family.base} has no rotary_emb; {ELSE}")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        raise UsageError(f"--strategy pipeline: {name} has no lm_head; {ELSE}")
    embeddings = Embeddings(getattr(base, family.tokens),
                            getattr(base, family.positions) if family.positions else None,
                            getattr(base, family.dropout) if family.dropout else None,
                            " + ".join(n for n in (family.tokens, family.positions) if n))
    return ([embeddings]
            + [DecoderBlock(block, model.config, mask, rotary) for block, mask in zip(blocks, masks)]
            + [Head(getattr(base, family.norm), head, f"{family.norm} + lm_head")])


def _base_model(model: nn.Module, family: Family) -> nn.Module:
    """The model's base model, checked to be ``family.base`` with that class's own forward."""
    name = type(model).__name__
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    base_class = _defining(base, family.base) if isinstance(base, nn.Module) else None
    if base_class is None:
        raise UsageError(f"--strategy pipeline: {name} has no {family.base} (the base model its cut follows); {ELSE}")
    if type(base).forward is not base_class.forward:
        raise UsageError(f"--strategy pipeline: {name}'s {type(base).__name__} has a forward of its own, and the cut "
                         f"follows {family.base}.forward; {ELSE}")
    return base


def _defining(obj: Any, class_name: str) -> Optional[type]:
    """The transformers class named ``class_name`` among ``obj``'s classes, or None."""
    return next((cls for cls in type(obj).__mro__
                 if cls.__name__ == class_name and cls.__module__.startswith("transformers.")), None)


def _family(model: nn.Module) -> Family:
    """The family of the known causal-LM class ``model`` is (its forward unchanged)."""
    name = type(model).__name__
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES and cls.__module__.startswith("transformers."):
            if type(model).forward is not cls.forward:
                raise UsageError(f"--strategy pipeline: {name} overrides {cls.__name__}.forward, and the cut "
                                 f"computes {cls.__name__}'s; {ELSE}")
            return FAMILIES[cls.__name__]
    known = ", ".join(FAMILIES)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or not _causal_lm(model):
        raise UsageError(f"--strategy pipeline cuts transformers decoder-only causal LMs at their blocks ({known}); "
                         f"{name} is not one; {ELSE}")
    raise UsageError(f"--strategy pipeline cuts transformers causal LMs whose forward it follows ({known}); "
                     f"{name} is not among them; {ELSE}")


def _causal_lm(model: nn.Module) -> bool:
    """Whether transformers lists ``model``'s class (or a base of it) as a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    return any(cls.__name__ in names for cls in type(model).__mro__)


def _check_version(name: str) -> None:
    """The families' forwards were read in transformers 5 (4.x passes the layers other arguments)."""
    import transformers

    major = transformers.__version__.split(".")[0]
    if not major.isdigit() or int(major) < 5:
        raise UsageError(f"--strategy pipeline cuts {name} as transformers 5 computes it, and transformers "
                         f"{transformers.__version__} is installed: pip install 'transformers>=5', or {ELSE}")


def _blocks(model: nn.Module, base: nn.Module, family: Family) -> list[nn.Module]:
    """The blocks ``find_blocks`` finds, checked to be the decoder layers the base model runs, in order."""
    from scaleloop.strategies.blocks import find_blocks

    stack = list(getattr(base, family.stack))
    if family.first_n:
        stack = stack[:model.config.num_hidden_layers]
    found = find_blocks(model)
    if [id(b) for b in found.modules] != [id(b) for b in stack]:
        raise UsageError(f"--strategy pipeline: {type(model).__name__}'s blocks ({found.describe() or 'none'}, "
                         f"{found.source}) are not the {len(stack)} layers its {family.base} runs "
                         f"({family.stack}); {ELSE}")
    return stack


def _mask_function(config: Any, index: int, family: Family, name: str) -> Callable[..., Any]:
    """transformers' mask function that the base model uses for layer ``index``."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kind = "full_attention"
    if family.masks == "sliding_window" and getattr(config, "sliding_window", None) is not None:
        kind = "sliding_attention"
    elif family.masks == "layer_types":
        kind = config.layer_types[index]
    if kind == "full_attention":
        return create_causal_mask
    if kind == "sliding_attention":
        return create_sliding_window_causal_mask
    raise UsageError(f"--strategy pipeline: {name}'s layer {index} has attention {kind!r}, whose mask the cut "
                     f"does not make; {ELSE}")


def _check_signature(block: nn.Module, family: Family, name: str) -> None:
    """The decoder layer names the arguments the cut gives it (not just ``**kwargs``, which would
    swallow one it does not take)."""
    wanted = ["attention_mask"] + (["position_embeddings"] if family.rotary else [])
    params = inspect.signature(block.forward).parameters
    missing = [w for w in wanted if w not in params]
    if missing:
        raise UsageError(f"--strategy pipeline: {name}'s {type(block).__name__}.forward takes no "
                         f"{', '.join(missing)}, which the cut passes it; {ELSE}")
