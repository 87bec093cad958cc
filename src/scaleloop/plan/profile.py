"""What the planner knows about a model, learnt without allocating it.

The model is built on the ``meta`` device (shapes only), then given fake storage under
``FakeTensorMode`` and run once forward and backward on one fake sample of ``seq_len`` tokens:
:mod:`scaleloop.plan.trace` records the bytes alive op by op, and ``torch.utils.flop_counter``
counts the FLOPs. A second trace runs with activation checkpointing on the model's blocks
(``scaleloop.strategies.recompute``, what ``--activation-checkpointing`` applies). The
parameter counts per block, outside the blocks, in the layers tensor parallelism splits and per
pipeline layer come from the same meta model.

Models: ``tinygpt`` at any size (``d_model``, ``n_layers``, ``n_heads``, ``vocab_size``),
a Hugging Face causal LM from a local ``config.json`` (built as ``scaleloop train`` builds it,
:mod:`scaleloop.hfconfig`: no download, no weights), or ``pkg.module:factory`` (called with the
data's ``DataInfo``). The loss follows the model's output: per-token logits ``(batch, seq, vocab)``
are a language model's (next token), ``(batch, classes)`` a classifier's; a model whose forward
or output fits neither is refused in one line.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

import torch
from torch import nn

from scaleloop.errors import UsageError
from scaleloop.plan.trace import StepSeries, trace_step

if TYPE_CHECKING:
    from scaleloop.strategies.blocks import Blocks


@dataclass(frozen=True)
class ModelSpec:
    """Which model to plan for, and its sizes (those of TinyGPT; the others read their own)."""

    model: str = "tinygpt"
    seq_len: int = 2048
    vocab_size: int = 32000
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32

    def describe(self) -> str:
        if self.model == "tinygpt":
            return (f"tinygpt (d_model {self.d_model}, {self.n_layers} layers, {self.n_heads} heads, "
                    f"vocabulary {self.vocab_size:,}, {self.seq_len} tokens)")
        return f"{self.model} ({self.seq_len} tokens)"


@dataclass(frozen=True)
class ModelProfile:
    """Parameter counts, FLOPs and the traced step of one sample (see the module docstring)."""

    spec: ModelSpec
    parameters: int                       # distinct parameter elements (tied ones once)
    block_parameters: tuple[int, ...]     # each block's (FSDP unit, checkpointed unit)
    tp_parameters: int                    # in the layers the model's tp_plan() splits (0: no plan)
    hidden: Optional[int]                 # the width of the activations between blocks
    heads: Optional[int]
    flops_per_sample: float               # forward and backward, counted
    series: StepSeries                    # one sample, fp32 or the low precision
    series_checkpointed: Optional[StepSeries]
    layers: tuple[nn.Module, ...] = field(default=(), compare=False, repr=False)   # meta: a pipeline's cut
    block_layers: tuple[bool, ...] = ()   # which of ``layers`` are blocks (the rest: embeddings, the head)
    dtype_bytes: int = 4                  # of the traced activations
    vocab_size: int = 0                   # the model's own (a config's), else the spec's
    task: str = "lm"                      # what its output is: "lm" (per-token logits) or "classification"
    summary: str = ""                     # its class and blocks: "LlamaForCausalLM; blocks: 32 x ..."
    #: One tensor-parallel rank's traced steps, by (tp, checkpointed), traced when first asked.
    _rank_series: dict[tuple[int, bool], Optional[StepSeries]] = field(default_factory=dict, compare=False,
                                                                       repr=False)

    @property
    def root_parameters(self) -> int:
        """Parameters outside every block (embeddings, the last norm, the output layer)."""
        return self.parameters - sum(self.block_parameters)

    def rank_series(self, tp: int, checkpointed: bool) -> Optional[StepSeries]:
        """The step of one sample on one of ``tp`` tensor-parallel ranks, traced on that rank's
        slices of the layers (:mod:`scaleloop.plan.tplocal`); None where the model's split is not
        one that can be cut so (then the memory model estimates the share)."""
        key = (tp, checkpointed)
        if key not in self._rank_series:
            dtype = torch.bfloat16 if self.dtype_bytes == 2 else torch.float32
            traced = _trace(self.spec, dtype, checkpointed, count_flops=False, tp=tp)
            self._rank_series[key] = traced[0] if traced is not None else None
        return self._rank_series[key]


def _tinygpt(spec: ModelSpec) -> nn.Module:
    from scaleloop.data.settings import tinygpt_sizes
    from scaleloop.models import TinyGPT

    tinygpt_sizes("tinygpt", spec.d_model, spec.n_layers, spec.n_heads)   # train's checks, train's words
    return TinyGPT(spec.vocab_size, spec.seq_len, d_model=spec.d_model, n_layers=spec.n_layers, n_heads=spec.n_heads)


def build_meta(spec: ModelSpec) -> nn.Module:
    """The model with meta tensors: every shape, no memory."""
    from scaleloop.hfconfig import build_causal_lm, is_config_path
    from scaleloop.plugins import is_factory_spec

    with torch.device("meta"):
        if spec.model == "tinygpt":
            return _tinygpt(spec)
        if is_factory_spec(spec.model):
            from scaleloop.data.info import DataInfo
            from scaleloop.models import build_model

            return build_model(spec.model, DataInfo("tokens", "lm", (spec.seq_len,), spec.vocab_size))
        if is_config_path(spec.model):
            # As ``scaleloop train --model CONFIG`` builds it: the same checks, no KV cache.
            return build_causal_lm(spec.model, seq_len=spec.seq_len)
    raise UsageError(f"--model {spec.model!r}: plan takes tinygpt, a Hugging Face config.json, or package.module:factory")


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _tp_parameters(model: nn.Module) -> int:
    """Parameter elements in the layers the model's ``tp_plan()`` splits (0 without a plan)."""
    plan_of = getattr(model, "tp_plan", None)
    if not callable(plan_of):
        return 0
    try:
        names = plan_of(1)
    except ValueError:
        return 0
    modules = dict(model.named_modules())
    total = 0
    for name, style in names.items():
        module = modules.get(name)
        if module is None:
            continue
        bias = getattr(module, "bias", None)
        # A row-wise split cuts the weight by its input; the bias is added whole on every rank.
        whole = bias.numel() if style.startswith("rowwise") and isinstance(bias, torch.Tensor) else 0
        total += _count(module) - whole
    return total


def _layers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The layers a pipeline would cut (empty where the model cannot be cut)."""
    from scaleloop.strategies.pipeline import pipeline_layers

    try:
        return tuple(pipeline_layers(model))
    except UsageError:
        return ()


def _hidden(model: nn.Module) -> tuple[Optional[int], Optional[int]]:
    """The width between blocks and the attention heads, where the model says them."""
    config = getattr(model, "config", None)
    if config is not None:
        return getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    emb = getattr(model, "tok_emb", None)
    blocks = getattr(model, "blocks", None)
    heads = getattr(getattr(blocks[0], "attn", None), "n_heads", None) if blocks else None
    return (emb.embedding_dim if isinstance(emb, nn.Embedding) else None), heads


class Traced(NamedTuple):
    """One traced step: the bytes op by op, the FLOPs (when counted) and the model's task."""

    series: StepSeries
    flops: float
    task: str


def _task_loss(model_name: str, output: object, tokens: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The task the model's output says, and the loss a run of it would take: next-token
    cross-entropy over per-token logits, or cross-entropy over one row of class logits a sample
    (against class 0: the target's value costs nothing the trace would see)."""
    logits = getattr(output, "logits", output)
    if isinstance(output, dict):
        logits = output.get("logits")
    if isinstance(logits, torch.Tensor):
        if logits.dim() == 3 and logits.shape[:2] == tokens.shape:
            return "lm", nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        if logits.dim() == 2 and logits.shape[0] == tokens.shape[0]:
            target = torch.zeros(tokens.shape[0], dtype=torch.long)
            return "classification", nn.functional.cross_entropy(logits.float(), target)
    shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(output).__name__
    raise UsageError(f"--model {model_name}: given token ids shaped {tuple(tokens.shape)}, it returned {shape}; plan "
                     "traces a model returning per-token logits (batch, seq, vocab) or class logits (batch, classes)")


@contextmanager
def _user_forward(spec: ModelSpec) -> Iterator[None]:
    """Around the trace of a model scaleloop did not write: its failure is one line naming it,
    not a traceback from inside its forward (tinygpt's would be scaleloop's bug: left as it is)."""
    # The fake tensors log every failed shape check as an error of their own before raising it:
    # the one line below says it, so that log is held back while the model runs.
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    except (RuntimeError, ValueError, TypeError, IndexError, KeyError, AttributeError) as exc:
        if spec.model == "tinygpt":
            raise
        text = str(exc).strip().splitlines()
        raise UsageError(f"--model {spec.model}: its forward and backward on one sample of {spec.seq_len} token ids "
                         f"failed ({type(exc).__name__}: {text[0] if text else ''})") from None
    finally:
        fake_log.setLevel(level)


def _trace(spec: ModelSpec, dtype: torch.dtype, checkpointed: bool, count_flops: bool,
           tp: int = 1) -> Optional[Traced]:
    """One sample's traced step on a fresh fake model (and its FLOPs when asked); with ``tp`` > 1
    on one tensor-parallel rank's slices (None when the model's split cannot be cut so)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from scaleloop.plan.tplocal import shrink_to_rank
    from scaleloop.strategies.recompute import checkpoint_blocks

    model = build_meta(spec)
    if tp > 1 and not shrink_to_rank(model, tp):
        return None
    model = model.to(dtype)
    if checkpointed:
        checkpoint_blocks(model)
    tasks: list[str] = []

    def forward_loss() -> torch.Tensor:
        task, loss = _task_loss(spec.model, model(tokens), tokens)
        tasks.append(task)
        return loss

    with FakeTensorMode(allow_non_fake_inputs=True), _user_forward(spec):
        model = model.to_empty(device="cpu")
        tokens = torch.zeros((1, spec.seq_len), dtype=torch.long)
        if not count_flops:
            return Traced(trace_step(model, forward_loss, [tokens]), 0.0, tasks[0])
        counter = FlopCounterMode(display=False)
        with counter:
            series = trace_step(model, forward_loss, [tokens])
        return Traced(series, float(counter.get_total_flops()) + series.attention_flops, tasks[0])


def _summary(model: nn.Module, found: "Blocks") -> str:
    """The model's class and its blocks, as FSDP and checkpointing will find them."""
    if not found.modules:
        return f"{type(model).__name__}; no blocks: {found.source}"
    return f"{type(model).__name__}; blocks: {found.describe()}, {found.source}"


def profile_model(spec: ModelSpec, low_precision: bool = False) -> ModelProfile:
    """Everything :mod:`scaleloop.plan.memory` and :mod:`scaleloop.plan.timing` need (module docstring).

    ``low_precision``: trace the step in bf16 (activations of 2 bytes), as a bf16 run keeps them.
    """
    from scaleloop.strategies.blocks import find_blocks
    from scaleloop.strategies.pipeline import is_pipeline_block

    model = build_meta(spec)
    found = find_blocks(model)
    blocks = [b for b in found.modules if b is not model]
    hidden, heads = _hidden(model)
    layers = _layers(model)
    dtype = torch.bfloat16 if low_precision else torch.float32
    plain = _trace(spec, dtype, checkpointed=False, count_flops=True)
    assert plain is not None   # only a tensor-parallel trace can be None
    checkpointed = _trace(spec, dtype, checkpointed=True, count_flops=False) if blocks else None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return ModelProfile(spec=spec, parameters=_count(model), block_parameters=tuple(_count(b) for b in blocks),
                        tp_parameters=_tp_parameters(model), layers=layers,
                        block_layers=tuple(is_pipeline_block(layer) or any(layer is b for b in blocks) for layer in layers),
                        hidden=hidden,
                        heads=heads, flops_per_sample=plain.flops, series=plain.series,
                        series_checkpointed=checkpointed.series if checkpointed is not None else None,
                        dtype_bytes=2 if low_precision else 4,
                        vocab_size=vocab if isinstance(vocab, int) else spec.vocab_size, task=plain.task,
                        summary=_summary(model, found))
