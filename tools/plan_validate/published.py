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
- **Model states, FSDP on 8 and on 128 GPUs.** torchtitan's ``docs/performance.md`` (Tables 1 and
  3; torchtitan 9dec370, torch 1963fc8, December 2024; https://github.com/pytorch/torchtitan/blob/main/docs/performance.md):
  Llama 3.1 8B, FSDP2, local batch 2, selective activation checkpointing, H100s: 82.4 GiB per GPU
  on 8 GPUs and 67.0 GiB on 128 (77.0 and 62.0 with ``torch.compile``; 76.8 and 61.8 with Float8
  too). Only the batch-independent, sharded part changes between the two: the difference is the
  model states' 1/8 - 1/128 of 16 bytes a parameter (FSDP2 keeps fp32 shards, fp32 gradients and
  Adam's two fp32 moments). Activations, which the plan does not model for selective checkpointing
  (only none or full), cancel out.
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


#: torchtitan's per-GPU memory (GiB) of Llama 3.1 8B under FSDP2, on 8 and on 128 GPUs, by technique.
TORCHTITAN_FSDP_GIB = {"FSDP": (82.4, 67.0), "FSDP + torch.compile": (77.0, 62.0),
                       "FSDP + torch.compile + Float8": (76.8, 61.8)}
TORCHTITAN_SOURCE = ("torchtitan docs/performance.md, Tables 1 (8 GPUs) and 3 (128 GPUs): Llama 3.1 8B, FSDP2, "
                     "local batch 2, selective activation checkpointing")


def llama_parameters(vocab: int, dim: int, layers: int, ffn: int, heads: int, kv_heads: int) -> int:
    """Parameters of a Llama (untied embedding and output layer, grouped-query attention, SwiGLU MLP,
    RMSNorm weights): Llama 3.1 8B is ``llama_parameters(128256, 4096, 32, 14336, 32, 8)``."""
    head = dim // heads
    attention = 2 * dim * dim + 2 * dim * kv_heads * head
    return 2 * vocab * dim + layers * (attention + 3 * dim * ffn + 2 * dim) + dim


LLAMA31_8B = llama_parameters(128256, 4096, 32, 14336, 32, 8)


def torchtitan_checks() -> list[tuple[Published, float]]:
    """(torchtitan's per-GPU memory on 8 GPUs less that on 128, the plan's model states on 8 less on 128)."""
    ours = model_states(LLAMA31_8B, Layout("fsdp", fsdp=8)) - model_states(LLAMA31_8B, Layout("fsdp", fsdp=128))
    out = []
    for technique, (on_8, on_128) in TORCHTITAN_FSDP_GIB.items():
        what = f"Llama 3.1 8B, {technique}: per-GPU memory on 8 GPUs less on 128 ({on_8} - {on_128} GiB)"
        out.append((Published(what, TORCHTITAN_SOURCE, (on_8 - on_128) * 2**30), ours))
    return out
