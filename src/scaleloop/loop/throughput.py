"""A log row's speed beside its samples/s: tokens/s for token data, and MFU where the device's peak is known.

What the figures need is fixed once, when the run is built (:func:`throughput_of`, on the model as
the user made it, before a strategy wraps, shards or cuts it); a log row only divides
(:meth:`Throughput.values`), so the steps between rows pay nothing for them.

- **Tokens** (``tokens_per_s``): token data only, whose samples are sequences of token ids (the
  built-in ``tokens``, token files, token streams, a dataset of task ``lm``), over all ranks.
  Where the data holds no -100 target (the built-in token data, token files) every position of
  every sample counts: samples x sequence length. Where it may (padding, a stream of unknown
  content), the positions whose target enters the loss, as the steps count them anyway to weigh
  the loss (``loop.padding``: summed over the ranks at every step already).
- **MFU** (``mfu``, a fraction): the model FLOPs of those tokens per second over the peak of all
  devices: each rank's datasheet peak in the run's precision (``runtime.devices``) x ranks. Model
  FLOPs per token are 6 N (N: the parameters a token is multiplied by, which is all of them but an
  embedding table that is only looked up, such as positions; a table tied to the output layer
  counts) plus the attention's 12 x layers x width x sequence length, where the model says its
  layers and width (TinyGPT, a transformers model's config, nanoGPT's ``GPTConfig``); 6 N alone
  otherwise. This is PaLM's count, as nanoGPT and torchtitan make it: the half of the scores a
  causal mask skips counts too. MFU is blank where no peak is known (the CPU, MPS, a GPU missing
  from the table) and for data that are not token data (6 N per sample is no estimate for a
  convolution, which uses its weights at every position of an image).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from scaleloop.data.info import DataInfo
from scaleloop.models import TinyGPT
from scaleloop.runtime.devices import datasheet_peak
from scaleloop.runtime.dist import DistEnv


@dataclass(frozen=True)
class Throughput:
    """What a run's speed columns are computed from (see the module docstring); None: not known."""

    tokens_per_sample: Optional[int] = None     # token data: the positions of a sample; None: not token data
    flops_per_token: Optional[float] = None     # the model's training FLOPs of one token
    peak_flops_per_s: Optional[float] = None    # of all devices together

    def tokens(self, samples: int, counted: Optional[float] = None) -> Optional[float]:
        """The tokens in ``samples`` trained samples: ``counted`` (the steps' count of positions
        whose target enters the loss) where given, else every position; None: not token data."""
        if self.tokens_per_sample is None:
            return None
        return counted if counted is not None else float(samples * self.tokens_per_sample)

    def values(self, tokens: Optional[float], seconds: float) -> dict[str, Optional[float]]:
        """A log row's ``tokens_per_s`` and ``mfu`` (None: left blank) for ``tokens`` trained in
        ``seconds``; nothing for data that are not tokens."""
        if tokens is None:
            return {}
        rate = tokens / max(seconds, 1e-9)
        known = self.flops_per_token is not None and self.peak_flops_per_s is not None
        return {"tokens_per_s": rate,
                "mfu": rate * self.flops_per_token / self.peak_flops_per_s if known else None}


def throughput_of(model: nn.Module, info: DataInfo, precision: str, env: DistEnv) -> Throughput:
    """The run's :class:`Throughput`: ``model`` as built (whole, unwrapped) for data ``info``,
    trained in ``precision`` on every rank of ``env``."""
    if info.task != "lm" or len(info.input_shape) != 1:
        return Throughput()
    positions = int(info.input_shape[0])
    peak = datasheet_peak(env.device, precision)
    return Throughput(tokens_per_sample=positions, flops_per_token=flops_per_token(model, positions),
                      peak_flops_per_s=peak.flops_per_s * env.world_size if peak is not None else None)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward and backward) of one token of a sequence of ``seq_len``: 6 N plus the
    attention's 12 x layers x width x ``seq_len`` where the model says its shape (module docstring)."""
    attention = attention_shape(model)
    scores = 12.0 * attention[0] * attention[1] * seq_len if attention is not None else 0.0
    return 6.0 * multiplied_parameters(model) + scores


def multiplied_parameters(model: nn.Module) -> int:
    """The parameter elements a token is multiplied by: all distinct ones but the tables of
    ``nn.Embedding`` layers that nothing else uses (a lookup is no multiplication; a table tied to
    the output layer is one)."""
    looked_up = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if not isinstance(module, nn.Embedding):
            for p in module.parameters(recurse=False):
                looked_up.pop(id(p), None)
    return sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in looked_up.values())


def attention_shape(model: nn.Module) -> Optional[tuple[int, int]]:
    """``(layers, attention width)`` of a transformer that says them: TinyGPT, a transformers
    model (its ``config``: heads x head size), nanoGPT's GPT (``config.n_layer``, ``n_embd``); else None."""
    if isinstance(model, TinyGPT):
        return len(model.blocks), model.tok_emb.embedding_dim
    config = getattr(model, "config", None)
    layers = _int_attr(config, "num_hidden_layers", "n_layer")
    heads = _int_attr(config, "num_attention_heads", "n_head")
    width = _int_attr(config, "hidden_size", "n_embd")
    if layers is None or width is None:
        return None
    head_dim = _int_attr(config, "head_dim")   # where it is not width / heads (Gemma's)
    return layers, heads * head_dim if heads is not None and head_dim is not None else width


def _int_attr(config: Any, *names: str) -> Optional[int]:
    """The first of ``names`` that ``config`` holds as a positive int."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
