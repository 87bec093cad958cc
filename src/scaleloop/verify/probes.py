"""Small experiments on the user's own model and loss that name why N ranks can differ from one.

Each probe runs on a deep copy, in one process, on the first step's batch, so it disturbs
neither the model nor the random number generators of the runs being compared.
"""
from __future__ import annotations

import copy
import math
import pickle
import random as py_random
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

from scaleloop.data.batch import call_model
from scaleloop.data.datasets import IGNORE_INDEX
from scaleloop.strategies.syncbn import GlobalBatchNorm
from scaleloop.loop.losses import LossFn, own_loss, prediction_of
from scaleloop.verify.hashing import digest


def unsynced_batchnorm(model: nn.Module) -> list[str]:
    """BatchNorm layers that normalise with the statistics of this process's batch only."""
    return [f"{name} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, (GlobalBatchNorm, nn.SyncBatchNorm))]


def dropout_layers(model: nn.Module) -> list[str]:
    """Modules that drop activations at random in training (``nn.Dropout*``, or a ``dropout`` > 0 setting)."""
    found = []
    for name, m in model.named_modules():
        p = m.p if isinstance(m, nn.modules.dropout._DropoutNd) else getattr(m, "dropout", None)
        if isinstance(p, (int, float)) and not isinstance(p, bool) and p > 0:
            found.append(f"{name or type(m).__name__} ({type(m).__name__}, p={p:g})")
    return found


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def draws_random_numbers(model: nn.Module, x: torch.Tensor) -> bool:
    """True if a training-mode forward pass consumes the global random number generator.

    It catches what a module list cannot: ``F.dropout`` in a forward, attention dropout,
    noise layers. Each rank seeds its generator with ``seed + rank``, so such draws differ.
    """
    probe = copy.deepcopy(model).train()
    before = _rng_states(x.device)
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), torch.no_grad():
        probe(x)
        after = _rng_states(x.device)
    return any(not torch.equal(a, b) for a, b in zip(before, after))


def _forward_once(probe: nn.Module, x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``probe``'s training-mode output for ``x`` after seeding the global generator with ``seed``,
    and that generator's state after the forward; the caller's generator state is left as it was."""
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        out = prediction_of(probe(x)).float()
        return out, torch.get_rng_state()


@dataclass(frozen=True)
class Randomness:
    """Where a forward pass's randomness comes from, beyond the global generator's plain draws.

    ``private``: two passes from the same global generator state give different outputs, and the
    model draws random numbers to do so: a generator it keeps (``torch.Generator``, numpy's,
    ``random``'s) advanced, numpy's or ``random``'s global one did, or two fresh copies of the
    model differ in their first pass. Such a generator differs per rank when it is seeded from the
    rank or not seeded at all. ``reseeds``: the global generator's state after a pass does not
    depend on its state before: the forward calls ``torch.manual_seed`` itself, with a seed of its
    own choosing. ``stateful``: two passes differ although nothing was drawn: the forward depends
    on its earlier calls (a call counter, an aux head used every other step): no randomness, but,
    like it, no forward that repeats itself, which the probe of the batch's coupling needs.
    """

    private: bool
    reseeds: bool
    stateful: bool = False


def _generator_states(model: nn.Module) -> bytes:
    """The state of every generator a forward may draw from besides torch's global ones: numpy's
    and ``random``'s global generators, and the generators the model's modules keep as attributes."""
    states: list[Any] = [py_random.getstate(), np.random.get_state(legacy=False)]
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Generator):
                states.append(value.get_state())
            elif isinstance(value, py_random.Random):
                states.append(value.getstate())
            elif isinstance(value, (np.random.Generator, np.random.RandomState)):
                states.append(value.bit_generator.state if isinstance(value, np.random.Generator)
                              else value.get_state(legacy=False))
    return pickle.dumps(states)


def forward_randomness(model: nn.Module, x: torch.Tensor) -> Randomness:
    """Probe a training-mode forward pass for private generators and re-seeding (see :class:`Randomness`)."""
    # One copy for all three passes: a generator of the model's own advances between them.
    probe = copy.deepcopy(model).train()
    before = _generator_states(probe)
    first, after_first = _forward_once(probe, x, 1234)
    drew = _generator_states(probe) != before
    again, _ = _forward_once(probe, x, 1234)
    _, after_other = _forward_once(probe, x, 4321)
    varies = not torch.equal(first, again)
    # A generator outside the model (one at module level): a fresh copy's first pass differs too.
    private = varies and (drew or not torch.equal(first, _forward_once(copy.deepcopy(model).train(), x, 1234)[0]))
    return Randomness(private=private, reseeds=torch.equal(after_first, after_other),
                      stateful=varies and not private)


def output_digest(model: nn.Module, x: torch.Tensor, seed: int = 0) -> str:
    """SHA-256 of the training-mode output for ``x`` from a fixed global seed: the same on every
    rank unless the forward depends on the rank (code that branches on it, a per-rank generator)."""
    return digest(_forward_once(copy.deepcopy(model).train(), x, seed)[0])


def sample_draws(dataset: Any, index: int) -> Optional[str]:
    """Whether reading sample ``index`` draws random numbers (augmentation in ``__getitem__``).

    ``"global"``: the sample read depends on the global generator's state, which each rank
    seeds with seed + rank; ``"private"``: two reads from the same state differ (a generator of
    its own, or numpy's/``random``'s); None: reading is deterministic.
    """
    def read(seed: int) -> str:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return digest(dataset[index])

    first = read(1234)
    if read(1234) != first:
        return "private"
    return "global" if read(4321) != first else None


def unused_parameters(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> list[str]:
    """Parameters that get no gradient from one forward and backward (DDP fails on them by default)."""
    probe = copy.deepcopy(model).train()
    probe.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        loss_fn(probe(x), y).backward()
    return [n for n, p in probe.named_parameters() if p.requires_grad and p.grad is None]


def batch_coupling(model: nn.Module, x: torch.Tensor, sizes: Sequence[int]) -> float:
    """How much a sample's output depends on the rest of its batch (0: not at all).

    The largest difference between the outputs for the whole batch and for its ``sizes``
    pieces run separately, relative to the largest output, in training mode with the same
    random draws. BatchNorm couples the samples of a batch; most layers do not.
    """
    probe = copy.deepcopy(model).train()
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(0)
        whole = probe(x).float()
        torch.manual_seed(0)
        parts = torch.cat([probe(p).float() for p in x.split(list(sizes))])
    scale = float(whole.abs().max())
    return float((whole - parts).abs().max()) / scale if scale > 0 else 0.0


@dataclass(frozen=True)
class LossSplit:
    """How the loss of a batch relates to the losses of the pieces the ranks compute.

    ``kind``: ``mean`` (the batch loss is the sample-weighted mean of its pieces' losses: what
    N ranks need), ``sum`` (the plain sum of them: a summed loss), ``count`` (a mean weighted by
    a count of each piece's own: a loss normalised per piece, such as a mean over each micro-batch's
    valid tokens), ``batch`` (no weighting of the pieces by their targets explains it: a term of the
    whole batch that is no mean over its samples, such as a penalty on the batch's mean output),
    ``other`` (neither mean nor sum, and ``count`` and ``batch`` not told apart); see
    :func:`count_or_batch`.
    """

    kind: str
    whole: float
    weighted_mean: float
    total: float
    pieces: int


def loss_split(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor,
               groups: Sequence[Sequence[int]], rtol: float = 1e-4) -> LossSplit:
    """Compare the loss of each reference piece with the losses of its distributed pieces.

    ``groups[i]`` lists the sizes of the distributed pieces (rank x micro-step) that make up
    the i-th piece of the reference run (its micro-batches, or the whole step). The model's
    outputs are computed once, in eval mode, so only the loss function is under test.
    """
    probe = copy.deepcopy(model).eval()
    with torch.no_grad():
        out = prediction_of(probe(x)).float()
        split = _split(lambda start, n: float(loss_fn(out[start:start + n], y[start:start + n])), groups, rtol)
        if split.kind == "other":
            split = replace(split, kind=count_or_batch(loss_fn, out, y, sum(groups[0])))
        return split


def _split(loss_of: Callable[[int, int], float], groups: Sequence[Sequence[int]], rtol: float) -> LossSplit:
    """:func:`loss_split`'s comparison, given ``loss_of(start, n)``: the loss of samples ``start..start+n``."""
    mean_ok = sum_ok = True
    worst = (0.0, 0.0, 0.0, 0.0)  # (deviation, whole, mean, sum)
    start = 0
    for sizes in groups:
        n = sum(sizes)
        whole = loss_of(start, n)
        losses, offset = [], start
        for size in sizes:
            losses.append(loss_of(offset, size))
            offset += size
        mean = sum(size / n * loss for size, loss in zip(sizes, losses))
        total = sum(losses)
        tol = rtol * max(abs(whole), 1e-6)
        mean_ok &= abs(whole - mean) <= tol
        sum_ok &= abs(whole - total) <= tol
        if abs(whole - mean) >= worst[0]:
            worst = (abs(whole - mean), whole, mean, total)
        start += n
    kind = "mean" if mean_ok else ("sum" if sum_ok else "other")
    return LossSplit(kind, worst[1], worst[2], worst[3], sum(len(g) for g in groups))


def count_or_batch(loss_fn: LossFn, out: torch.Tensor, y: torch.Tensor, n: int) -> str:
    """Why the loss of the first ``n`` samples is no sample-weighted mean of its halves' losses:
    ``count``, ``batch``, or ``other`` when it cannot be told (see :class:`LossSplit`).

    A loss that divides a sum over its samples by a count of its own piece (valid tokens, unmasked
    samples, the weights of their classes) makes the loss of two pieces A and B together a weighted
    mean of theirs, ``L_AB = w L_A + (1 - w) L_B``, whose weight ``w = c_A / (c_A + c_B)`` comes from
    the targets alone. So ``w`` stays the same when the outputs change and the targets do not. A
    term of the whole batch that is no mean over its samples (a penalty on the batch's mean logit)
    has no such weight: ``w`` then moves with the outputs. Computed in float64 where the loss takes
    it, so that rounding cannot pass for either.
    """
    def weight(o: torch.Tensor) -> Optional[float]:
        half = n // 2
        la, lb, lab = (float(loss_fn(o[s:e], y[s:e])) for s, e in ((0, half), (half, n), (0, n)))
        if not all(math.isfinite(v) for v in (la, lb, lab)) or abs(la - lb) <= 1e-9 * max(abs(la), abs(lb), 1e-12):
            return None
        return (lab - lb) / (la - lb)

    if n < 2:
        return "other"
    weights: tuple[Optional[float], ...] = (None,)
    # float64 where the loss takes it; else (a loss with float32 tensors of its own) in the outputs'
    # dtype, with a tolerance for its rounding.
    for dtype, tol in ((torch.float64, 1e-6), (out.dtype, 1e-3)):
        whole = out[:n].to(dtype)
        noise = torch.randn(whole.shape, generator=torch.Generator().manual_seed(0), dtype=dtype).to(whole.device)
        try:
            weights = weight(whole), weight(whole + noise * float(whole.std().clamp(min=1e-3)))
            break
        except Exception:  # noqa: BLE001 (a loss that cannot take these outputs: tried otherwise, or left untold)
            continue
    if weights[0] is None or weights[-1] is None:
        return "other"
    counted = all(-tol <= w <= 1 + tol for w in weights) and abs(weights[0] - weights[1]) <= tol
    return "count" if counted else "batch"


@dataclass(frozen=True)
class PaddedLoss:
    """How a model's own loss over -100 padding relates to the losses of the pieces the ranks compute."""

    split: LossSplit
    real: list[int]        #: labels other than -100 in each distributed piece
    positions: list[int]   #: labels in each piece


def own_loss_split(model: nn.Module, x: Mapping[str, object], y: torch.Tensor, target_key: str,
                   groups: Sequence[Sequence[int]], rtol: float = 1e-4) -> Optional[PaddedLoss]:
    """:func:`loss_split` for a model that computes its own loss from keyword inputs and the labels
    ``y`` (given as ``target_key``), each piece a forward of its own in eval mode; None when the model
    returns no loss of its own."""
    rows = len(y)
    probe = copy.deepcopy(model).eval()

    def loss_of(start: int, n: int) -> float:
        inputs = {k: v[start:start + n] if isinstance(v, torch.Tensor) and v.dim() and len(v) == rows else v
                  for k, v in x.items()}
        inputs[target_key] = y[start:start + n]
        loss = own_loss(call_model(probe, inputs), given_target=True)
        if loss is None:
            raise LookupError("no own loss")
        return float(loss.float().mean())

    with torch.no_grad():
        try:
            split = _split(loss_of, groups, rtol)
        except LookupError:
            return None
    sizes = [size for g in groups for size in g]
    real = [int((piece != IGNORE_INDEX).sum()) for piece in y.split(sizes)]
    return PaddedLoss(split, real, [piece.numel() for piece in y.split(sizes)])


@dataclass(frozen=True)
class Probes:
    """Everything the probes found about one model and loss (None: the probe could not run)."""

    batchnorm: list[str]
    dropout: list[str]
    random: Optional[bool]
    unused: Optional[list[str]]
    coupling: Optional[float]
    loss: Optional[LossSplit]
    #: The model's own loss over -100 padding, where the run cannot make it exact (``loop.losses``).
    own_padded: Optional[PaddedLoss] = None
    randomness: Optional[Randomness] = None


def run_probes(model: nn.Module, loss_fn: LossFn, x: object, y: object,
               groups: Sequence[Sequence[int]], *, counted: bool = False,
               own_target: Optional[str] = None) -> Probes:
    """All probes on ``model`` with the first step's batch ``(x, y)`` (tensors on the model's device).

    Probes that must cut the batch into pieces need tensor inputs; for other inputs they are skipped,
    but for keyword inputs to a model that computes its own loss from the labels (``own_target``:
    the labels' keyword), whose loss is probed (:func:`own_loss_split`). ``counted``: the run
    weighs -100 padding over the whole step (``loop.losses``), so a loss that is a mean over
    each piece's real targets is no cause: the loss is not probed.
    """
    tensors = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    random = draws_random_numbers(model, x) if tensors else None
    own = forward_randomness(model, x) if tensors else None
    unused = unused_parameters(model, x, y, loss_fn) if tensors else None
    flat = [s for g in groups for s in g]
    # Outputs that change from one pass to the next differ between the whole batch and its pieces
    # whatever the layers do: only a deterministic forward can show a coupling of the samples.
    deterministic = not random and own is not None and not (own.private or own.reseeds or own.stateful)
    coupling = batch_coupling(model, x, flat) if tensors and deterministic and len(flat) > 1 else None
    split = loss_split(model, loss_fn, x, y, groups) if tensors and len(flat) > 1 and not counted else None
    padded = None
    if (own_target is not None and not counted and len(flat) > 1 and isinstance(x, Mapping)
            and isinstance(y, torch.Tensor)):
        padded = own_loss_split(model, x, y, own_target, groups)
    return Probes(unsynced_batchnorm(model), dropout_layers(model), random, unused, coupling, split,
                  own_padded=padded, randomness=own)
