"""Step-by-step comparison of the reference run with the distributed run, and its tolerances.

Two runs that do the same arithmetic in a different order (N partial sums all-reduced instead
of one sum) differ by rounding only. The tolerances below bound that rounding, per precision,
relative to the size of what is compared, so that a real difference (a wrong normalisation,
per-rank BatchNorm statistics) stands far above them:

- loss: ``|loss_1 - loss_N| / |loss_1|``;
- parameters after each step: ``max |p_1 - p_N|`` over all parameters, divided by the largest
  ``|p_1|`` (a difference measured against the scale of the weights);
- gradients of each step: ``max |g_1 - g_N|`` divided by the largest ``|g_1|`` of that step.

Adam and AdamW step each element by about ``lr`` whatever its gradient's size: where an
element's gradients of successive steps nearly cancel, a rounding difference in them moves
``m / sqrt(v)`` by a visible fraction, and the parameters part by a small share of ``lr``
although the gradients agree (seen: 2e-4 of ``lr`` after 2 steps of SimpleNet on one CPU,
1.5e-5 of the largest weight). Under those optimizers parameters also count as equal within
``ADAPTIVE_STEP_SHARE x lr`` per step taken. A bug in the optimizer's state or its learning rate
moves elements by whole steps (about ``lr``), far above that; a wrong gradient shows in the
gradient column, which is held to the same tolerance for every optimizer.

Free-running, both runs carry their rounding into the next step, and an adaptive optimizer
compounds it (the allowance above grows with the steps, and still was not always enough: a
pipeline TinyGPT parted by 4.3e-5 after 2 Adam steps, against 4.0e-5). The verdict therefore
comes from the lock-step comparison (``verify.lockstep``): one process takes every step from
the distributed run's own state before it, so a step's differences are that one step's
rounding, held to :meth:`Tolerance.per_step`: the same-weights gradient tolerance at every step,
one step's ``lr`` allowance, nothing carried over; and the optimizer state after the step is
compared too (:func:`optimizer_state_diff`), so that no part of the state escapes. The
free-running comparison (the trajectory) is shown beside it, under the tolerances above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from scaleloop.verify.recorder import step_file


@dataclass(frozen=True)
class Tolerance:
    """Largest relative differences that still count as equal (see the module docstring).

    ``first_grads`` bounds the gradients of step 1, which both runs compute from the same
    weights; ``grads`` those of later steps, computed from weights that already differ by
    rounding (the same for fp32).
    """

    precision: str
    loss: float
    params: float
    grads: float
    first_grads: float
    #: The learning rate of an adaptive optimizer (adam, adamw): see the module docstring.
    adaptive_lr: Optional[float] = None
    optimizer: str = ""
    #: Every step is taken from the same state by both runs (``verify.lockstep``): nothing compounds.
    lockstep: bool = False

    def per_step(self) -> "Tolerance":
        """These tolerances for the lock-step comparison: every step's gradients from the same weights
        (the step-1 bound), one step's share of ``lr`` under Adam, and the optimizer state compared."""
        return replace(self, lockstep=True)

    def grads_at(self, step: int) -> float:
        return self.first_grads if step == 1 or self.lockstep else self.grads

    @property
    def state(self) -> float:
        """The optimizer state after a step from the same state (lock-step), relative to its largest value:
        Adam's second moment is quadratic in the gradient, so twice the same-weights gradient tolerance."""
        return 2 * self.first_grads

    def adaptive_allowance(self, step: int) -> float:
        """How far parameters may part in absolute terms after ``step`` steps under an adaptive optimizer
        (0 without one): a share of ``lr`` per step, compounded free-running, one step in lock-step."""
        if self.adaptive_lr is None:
            return 0.0
        return ADAPTIVE_STEP_SHARE * self.adaptive_lr * (1 if self.lockstep else step)

    def params_equal(self, step: int, diff: float, rel: float) -> bool:
        """Parameters that differ by ``diff`` (``rel`` of the largest weight) after ``step`` steps count as equal."""
        if rel <= self.params:
            return True
        return self.adaptive_lr is not None and diff <= self.adaptive_allowance(step)

    def describe(self) -> str:
        if self.lockstep:
            adaptive = (f" (or within {ADAPTIVE_STEP_SHARE:.0e} x lr: one step of {self.optimizer} is about lr "
                        "whatever the gradient's size)" if self.adaptive_lr is not None else "")
            return (f"tolerance ({self.precision}): for one step from the same state, loss {self.loss:.0e} relative, "
                    f"parameters {self.params:.0e} of the largest weight{adaptive}, gradients {self.first_grads:.0e} "
                    f"of the largest gradient, optimizer state {self.state:.0e} of its largest value")
        grads = (f"gradients {self.grads:.0e} of the largest gradient" if self.first_grads == self.grads else
                 f"gradients {self.first_grads:.0e} of the largest gradient at step 1 (same weights), "
                 f"{self.grads:.0e} after")
        adaptive = (f" (or within {ADAPTIVE_STEP_SHARE:.0e} x lr per step: {self.optimizer}'s steps are about lr "
                    "whatever the gradient's size)" if self.adaptive_lr is not None else "")
        return (f"tolerance ({self.precision}): loss {self.loss:.0e} relative, parameters {self.params:.0e} "
                f"of the largest weight{adaptive}, {grads}")


# fp32: the summation-order rounding measured on the built-in models stays below ~1e-6 (loss,
# parameters) and ~1e-5 of the largest gradient. Under autocast every matmul's output is rounded
# to bf16 (8 mantissa bits, ~4e-3) or fp16 (11 bits, ~5e-4), and a kernel may round a batch of
# 16 rows differently from one of 32: the gradients of step 1 differ by about one unit in the
# last place (measured: bf16 3e-3, fp16 5e-4 of the largest gradient on ConvNet and SimpleNet),
# so step 1 allows ~5-10 of them. From step 2 on the weights differ by rounding and a network
# amplifies that where a ReLU or a max flips (measured up to 1e-1 by step 4), so later steps are
# bounded loosely. BatchNorm without synchronisation differs by ~6e-2 at step 1: caught there.
ADAPTIVE_STEP_SHARE = 2e-3
ADAPTIVE_OPTIMIZERS = ("adam", "adamw")

TOLERANCES = {
    "fp32": Tolerance("fp32", loss=1e-5, params=1e-5, grads=1e-4, first_grads=1e-4),
    "bf16": Tolerance("bf16", loss=2e-2, params=1e-2, grads=2e-1, first_grads=2e-2),
    "fp16": Tolerance("fp16", loss=5e-3, params=5e-3, grads=1e-1, first_grads=5e-3),
}


def tolerance_for(precision: str, params: Optional[float] = None, optimizer: str = "",
                  lr: Optional[float] = None) -> Tolerance:
    """The tolerances for ``precision``; ``params`` (``--tolerance``) scales all of them by
    params/default; an adaptive ``optimizer`` with its ``lr`` adds the per-step allowance."""
    base = TOLERANCES[precision]
    adaptive = lr if optimizer in ADAPTIVE_OPTIMIZERS else None
    if params is None and adaptive is None:
        return base
    factor = 1.0 if params is None else params / base.params
    return Tolerance(precision, loss=base.loss * factor, params=base.params * factor, grads=base.grads * factor,
                     first_grads=base.first_grads * factor, adaptive_lr=adaptive, optimizer=optimizer)


@dataclass(frozen=True)
class StepDiff:
    """How one step of the distributed run differs from the same step of the reference.

    ``param_abs``/``param_rel`` leave out the parameter elements whose gradient has been at
    rounding level (see :func:`compare_runs`); ``raw_param_rel`` includes them.
    """

    step: int
    loss_ref: float
    loss_run: float
    param_abs: float
    param_rel: float
    worst_param: str
    grad_rel: float
    worst_grad: str
    raw_param_rel: float = 0.0
    excluded: int = 0
    excluded_in: tuple[str, ...] = ()
    # The buffers the model saves (BatchNorm statistics, an EMA): floating ones as the parameters,
    # relative to the largest |buffer|; the others (counters) must be equal.
    buffer_abs: float = 0.0
    buffer_rel: float = 0.0
    worst_buffer: str = ""
    unequal_buffers: tuple[str, ...] = ()
    #: How far the parameter elements left out for rounding-level gradients had moved apart before
    #: this step: buffers computed from them (BatchNorm's running mean after such a bias) may differ
    #: as much, in absolute terms.
    buffer_allowance: float = 0.0
    #: Lock-step only: the optimizer state after the step (see :func:`optimizer_state_diff`).
    state_rel: float = 0.0
    worst_state: str = ""
    unequal_state: tuple[str, ...] = ()

    def buffers_equal(self, tol: Tolerance) -> bool:
        return tol.params_equal(self.step, self.buffer_abs, self.buffer_rel) or self.buffer_abs <= self.buffer_allowance

    @property
    def loss_rel(self) -> float:
        if math.isnan(self.loss_ref) or math.isnan(self.loss_run):
            return math.inf
        return abs(self.loss_ref - self.loss_run) / max(abs(self.loss_ref), 1e-12)

    def failures(self, tol: Tolerance) -> list[str]:
        """What exceeds the tolerance, in words (empty: this step matches)."""
        out = []
        if not self.loss_rel <= tol.loss:
            out.append(f"loss {self.loss_rel:.2e} relative (tolerance {tol.loss:.0e})")
        if not tol.params_equal(self.step, self.param_abs, self.param_rel):
            steps = "one step" if tol.lockstep else f"{self.step} step(s)"
            within = (f" or {tol.adaptive_allowance(self.step):.1e} absolute after {steps} of {tol.optimizer}"
                      if tol.adaptive_lr is not None else "")
            out.append(f"parameters {self.param_rel:.2e} of the largest weight (tolerance {tol.params:.0e}{within}), "
                       f"worst {self.worst_param}")
        if not self.grad_rel <= tol.grads_at(self.step):
            out.append(f"gradients {self.grad_rel:.2e} of the largest gradient (tolerance "
                       f"{tol.grads_at(self.step):.0e}), worst {self.worst_grad}")
        if not self.buffers_equal(tol):
            out.append(f"buffers {self.buffer_rel:.2e} of the largest buffer (tolerance {tol.params:.0e}), "
                       f"worst {self.worst_buffer}")
        if self.unequal_buffers:
            out.append(f"buffer {self.unequal_buffers[0]} differs"
                       + (f" (and {len(self.unequal_buffers) - 1} more)" if len(self.unequal_buffers) > 1 else ""))
        if not self.state_rel <= tol.state:
            out.append(f"optimizer state {self.state_rel:.2e} of its largest value (tolerance {tol.state:.0e}), "
                       f"worst {self.worst_state}")
        if self.unequal_state:
            out.append(f"optimizer state {self.unequal_state[0]} differs"
                       + (f" (and {len(self.unequal_state) - 1} more)" if len(self.unequal_state) > 1 else ""))
        return out


Tensors = dict[str, torch.Tensor]


def _pair(ref: Tensors, run: Tensors, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides of ``name`` in float64; a side that lacks it (no gradient) counts as zeros."""
    a, b = ref.get(name), run.get(name)
    a = a.double() if a is not None else torch.zeros_like(b, dtype=torch.float64)
    b = b.double() if b is not None else torch.zeros_like(a)
    return a, b


def _floating(ref: Tensors, run: Tensors) -> list[str]:
    names = list(ref) + [n for n in run if n not in ref]
    return [n for n in names if (ref.get(n) if ref.get(n) is not None else run[n]).is_floating_point()]


def tensor_diff(ref: Tensors, run: Tensors, skip: Optional[dict[str, torch.Tensor]] = None
                ) -> tuple[float, float, str]:
    """(largest absolute difference, that divided by the largest ``|ref|``, the tensor holding it).

    ``skip`` masks (True: leave out) elements of some tensors. A tensor missing on one side
    counts as zeros there; tensors of different shapes differ infinitely.
    """
    scale, worst_abs, worst = 0.0, 0.0, ""
    for name in _floating(ref, run):
        if name in ref and name in run and ref[name].shape != run[name].shape:
            return math.inf, math.inf, name
        a, b = _pair(ref, run, name)
        if not a.numel():
            continue
        scale = max(scale, float(a.abs().max()))
        d = (a - b).abs()
        if skip is not None and name in skip:
            d = d.masked_fill(skip[name], 0.0)
        top = float(d.max())
        if not top <= worst_abs:  # also catches NaN
            worst_abs, worst = top, name
    if math.isnan(worst_abs):
        return math.inf, math.inf, worst
    return worst_abs, worst_abs / scale if scale > 0 else (0.0 if worst_abs == 0 else math.inf), worst


def rounding_level(ref: Tensors, run: Tensors, grad_tol: float) -> dict[str, torch.Tensor]:
    """Gradient elements indistinguishable from rounding noise in this step (True), per parameter.

    Adam-like optimizers step by ``g / (sqrt(v) + eps)``: a gradient that is pure rounding
    noise (a bias followed by BatchNorm, whose true gradient is zero) becomes a full-size step
    whose sign the noise decides, so 1 and N processes move it differently although their
    gradients agree. Such elements: ``|g| <=`` 10x the largest gradient difference of the step
    (capped at the gradient tolerance) in both runs, unless it is exactly zero in both.
    """
    names = [n for n in _floating(ref, run) if not (n in ref and n in run and ref[n].shape != run[n].shape)]
    pairs = {n: _pair(ref, run, n) for n in names}
    noise = max((float((a - b).abs().max()) for a, b in pairs.values() if a.numel()), default=0.0)
    scale = max((float(a.abs().max()) for a, _ in pairs.values() if a.numel()), default=0.0)
    floor = min(10 * noise, grad_tol * scale)
    return {n: (a.abs() <= floor) & (b.abs() <= floor) & ~((a == 0) & (b == 0)) for n, (a, b) in pairs.items()}


def compare_runs(ref_dir: Path, run_dir: Path, ref_losses: list[float], run_losses: list[float],
                 steps: int, tol: Tolerance) -> list[StepDiff]:
    """One ``StepDiff`` per step both runs finished (at most ``steps``).

    Parameter elements whose gradient was at rounding level in this or an earlier step are left
    out of ``param_rel`` (see :func:`rounding_level`); a real difference between the runs shows
    in the loss and the gradients, which are always compared in full.

    The buffers both runs saved are compared too: floating ones as the parameters (relative to the
    largest buffer), others exactly. Once elements were left out, a buffer may also differ by as
    much as the parameters did (those elements included) at the step before: a running mean after
    a bias that Adam moved by +lr in one run and -lr in the other differs by its momentum's share of that.

    With ``tol.lockstep`` (``ref_dir`` holds one process's steps, each from the state the other run
    had before it) nothing is carried from step to step: an element is left out for its gradient
    at this step only, and buffers, computed from the same weights, get no allowance.
    """
    rows: list[StepDiff] = []
    noisy: dict[str, torch.Tensor] = {}
    noise_moved = 0.0   # the largest difference of the left-out elements, up to the previous step
    for step in range(1, steps + 1):
        a, b = step_file(ref_dir, step), step_file(run_dir, step)
        if not (a.exists() and b.exists()) or step > min(len(ref_losses), len(run_losses)):
            break
        ref = torch.load(a, weights_only=True)
        run = torch.load(b, weights_only=True)
        if tol.lockstep:
            noisy = {}
        for name, mask in rounding_level(ref["grads"], run["grads"], tol.grads_at(step)).items():
            noisy[name] = noisy[name] | mask if name in noisy and noisy[name].shape == mask.shape else mask
        p_abs, p_rel, p_worst = tensor_diff(ref["params"], run["params"], skip=noisy)
        raw_abs, raw_rel, _ = tensor_diff(ref["params"], run["params"])
        _, g_rel, g_worst = tensor_diff(ref["grads"], run["grads"])
        excluded = tuple(n for n, m in noisy.items() if bool(m.any()))
        b_abs, b_rel, b_worst = tensor_diff(ref.get("buffers", {}), run.get("buffers", {}))
        rows.append(StepDiff(step, ref_losses[step - 1], run_losses[step - 1], p_abs, p_rel, p_worst,
                             g_rel, g_worst, raw_rel, sum(int(noisy[n].sum()) for n in excluded), excluded,
                             b_abs, b_rel, b_worst, unequal_exact(ref.get("buffers", {}), run.get("buffers", {})),
                             noise_moved))
        if excluded and not tol.lockstep:
            noise_moved = max(noise_moved, raw_abs)
    return rows


@dataclass(frozen=True)
class StateDiff:
    """How one process's optimizer state after a step differs from the distributed run's, both
    stepped from the same state (lock-step): the largest difference of a state tensor relative to
    the largest value of its kind (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), where it is,
    and the counters (Adam's ``step``) that differ."""

    rel: float = 0.0
    worst: str = ""
    unequal: tuple[str, ...] = ()


OptimizerState = Mapping[str, Mapping[str, Any]]   # parameter name -> {kind: tensor or number}


def optimizer_state_diff(ref: OptimizerState, run: OptimizerState) -> StateDiff:
    """Compare two optimizer states by parameter name, kind by kind.

    Tensors of one element or more dimensions count as the parameters do: a parameter whose state
    one side lacks (it never had a gradient there) counts as zeros, as its gradient does. Scalars
    (Adam's ``step``) must be equal where both sides have them.
    """
    kinds = list(dict.fromkeys(k for side in (ref, run) for entry in side.values() for k in entry))
    rel, worst, unequal = 0.0, "", []
    for kind in kinds:
        a = {n: v[kind] for n, v in ref.items() if kind in v}
        b = {n: v[kind] for n, v in run.items() if kind in v}
        tensors = {n for n, v in (*a.items(), *b.items()) if isinstance(v, torch.Tensor) and v.dim() > 0}
        for name in (a.keys() & b.keys()) - tensors:
            if not _same_scalar(a[name], b[name]):
                unequal.append(f"{kind} of {name}")
        _, r, where = tensor_diff({n: a[n] for n in tensors if n in a}, {n: b[n] for n in tensors if n in b})
        if not r <= rel:
            rel, worst = r, f"{kind} of {where}"
    return StateDiff(rel, worst, tuple(unequal))


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def with_state(rows: list[StepDiff], states: Mapping[int, StateDiff]) -> list[StepDiff]:
    """``rows`` with the optimizer-state differences of their steps (lock-step) filled in."""
    return [replace(r, state_rel=states[r.step].rel, worst_state=states[r.step].worst,
                    unequal_state=states[r.step].unequal) if r.step in states else r for r in rows]


def unequal_exact(ref: Tensors, run: Tensors) -> tuple[str, ...]:
    """The tensors that are not floating point (counters such as BatchNorm's ``num_batches_tracked``)
    and differ between the runs, or that one run lacks: these must be equal, not merely close."""
    names = list(ref) + [n for n in run if n not in ref]
    floating = set(_floating(ref, run))
    return tuple(n for n in names if n not in floating
                 and not (n in ref and n in run and ref[n].shape == run[n].shape and torch.equal(ref[n], run[n])))


@dataclass(frozen=True)
class InitialDiff:
    """How rank 0's model as built (step 0) differs from the reference's: (largest relative difference,
    the tensor holding it) for the parameters and for the floating buffers, and unequal counters."""

    param_rel: float
    worst_param: str
    buffer_rel: float
    worst_buffer: str
    unequal: tuple[str, ...]

    def differs(self, tol: Tolerance) -> bool:
        return not (self.param_rel <= tol.params and self.buffer_rel <= tol.params) or bool(self.unequal)

    def worst(self) -> str:
        """The tensor that differs most (a parameter before a buffer)."""
        if self.param_rel > 0:
            return self.worst_param
        return self.worst_buffer or (self.unequal[0] if self.unequal else "")


def initial_diff(ref_dir: Path, run_dir: Path) -> Optional[InitialDiff]:
    """Compare the models both runs built, before any step (None: a side did not record step 0)."""
    a, b = step_file(ref_dir, 0), step_file(run_dir, 0)
    if not (a.exists() and b.exists()):
        return None
    ref, run = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    _, p_rel, p_worst = tensor_diff(ref["params"], run["params"])
    _, b_rel, b_worst = tensor_diff(ref["buffers"], run["buffers"])
    return InitialDiff(p_rel, p_worst, b_rel, b_worst,
                       unequal_exact(ref["params"], run["params"]) + unequal_exact(ref["buffers"], run["buffers"]))


def gradient_ratio(ref_dir: Path, run_dir: Path, tol: Tolerance) -> Optional[float]:
    """c when the first step's gradients of the distributed run are c times the reference's, for one
    c != 1 over every element (a loss or gradient scaled by hand); None when they are not.

    Step 1 is computed from the same weights in both runs, so a constant factor shows there
    exactly, up to rounding: the least-squares c, and what it leaves within the gradient tolerance.
    """
    a, b = step_file(ref_dir, 1), step_file(run_dir, 1)
    if not (a.exists() and b.exists()):
        return None
    ref, run = torch.load(a, weights_only=True)["grads"], torch.load(b, weights_only=True)["grads"]
    names = [n for n in _floating(ref, run) if n in ref and n in run and ref[n].shape == run[n].shape]
    if not names or len(names) != len(set(ref) | set(run)):
        return None
    g_ref = torch.cat([ref[n].double().reshape(-1) for n in names])
    g_run = torch.cat([run[n].double().reshape(-1) for n in names])
    norm = float(g_ref.dot(g_ref))
    if not norm > 0 or not torch.isfinite(g_run).all():
        return None
    c = float(g_ref.dot(g_run)) / norm
    scaled = c * g_ref
    residual = float((g_run - scaled).abs().max()) / max(float(scaled.abs().max()), 1e-300)
    if not residual <= tol.grads_at(1) or abs(c - 1) <= 10 * tol.grads_at(1) or c <= 0:
        return None
    return c
