"""The memory model against published figures (docs/planning.md, "Against published figures").

- **Model states, ZeRO.** Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models", Figure 1: a 7.5B-parameter model trained with mixed-precision
  Adam on 64 GPUs takes 120 GB of model states per GPU when replicated (16 bytes a parameter:
  fp16 parameters and gradients, an fp32 copy and two fp32 moments) and 1.9 GB with all three
  sharded (ZeRO stage 3, what FSDP does). scaleloop keeps fp32 parameters and gradients and
  two fp32 moments: 16 bytes a parameter too, split differently.
- **Activations, Megatron.** Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", section 4.1, equation 1: a GPT layer keeps ``s*b*h*(34 + 5*a*s/h)``
  bytes of 16-bit activations for the backward (sequence ``s``, batch ``b``, width ``h``, heads
  ``a``); the ``5*a*s/h`` part is the attention scores and their softmax and dropout, which a
  fused attention (PyTorch's ``scaled_dot_product_attention``, TinyGPT's) does not keep, so the
  comparison is with ``34*s*b*h``. Of the 34, 2 are the dropout masks after the attention and
  after the MLP (``s*b*h`` bytes each), which TinyGPT with dropout 0 does not keep either: its
  layer should keep ``32*s*b*h``.
"""
from __future__ import annotations

from dataclasses import dataclass

from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import MASTER_BYTES, OPTIMIZER_BYTES
from scaleloop.plan.profile import ModelProfile


@dataclass(frozen=True)
class Published:
    """A published figure, what it is of, and where it is from."""

    what: str
    source: str
    value: float          # bytes


ZERO_REPLICATED = Published("model states per GPU, 7.5B parameters, replicated (DDP), mixed-precision Adam",
                            "Rajbhandari et al. 2020 (ZeRO), Figure 1: 120 GB", 120e9)
ZERO_STAGE3 = Published("model states per GPU, 7.5B parameters, 64 GPUs, all sharded (ZeRO-3 / FSDP)",
                        "Rajbhandari et al. 2020 (ZeRO), Figure 1: 1.9 GB", 1.9e9)


def model_states(parameters: float, layout: Layout, optimizer: str = "adam") -> float:
    """Parameters, gradients and optimizer state per rank, as the plan counts them."""
    per_param = MASTER_BYTES + MASTER_BYTES + OPTIMIZER_BYTES[optimizer]
    return parameters * per_param / (layout.fsdp * layout.tp * layout.pp)


def zero_checks() -> list[tuple[Published, float]]:
    """(the published figure, the plan's) for ZeRO's Figure 1."""
    params = 7.5e9
    return [(ZERO_REPLICATED, model_states(params, Layout("dp", dp=64))),
            (ZERO_STAGE3, model_states(params, Layout("fsdp", fsdp=64)))]


def megatron_layer_bytes(seq: int, batch: int, hidden: int, heads: int, scores: bool = False) -> float:
    """Equation 1 of Korthikanti et al. 2022: one GPT layer's 16-bit activations, in bytes
    (``scores``: with the attention-score term that a fused attention does not keep)."""
    return seq * batch * hidden * (34 + (5 * heads * seq / hidden if scores else 0))


def traced_layer_bytes(profile: ModelProfile) -> float:
    """The plan's activations of one block for one sample: what the traced forward keeps,
    less what it keeps outside the blocks, over the blocks (a 16-bit profile for the comparison)."""
    blocks = len(profile.block_parameters)
    outside = profile.series_checkpointed.saved if profile.series_checkpointed else 0
    # The checkpointed forward keeps each block's input and what is outside the blocks.
    inputs = blocks * profile.spec.seq_len * (profile.hidden or 0) * profile.dtype_bytes
    return (profile.series.saved - (outside - inputs)) / blocks
