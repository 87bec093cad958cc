"""The equivalence tables (lock-step, free-running) and the verdict, as printed lines."""
from __future__ import annotations

from typing import Optional, Sequence

from scaleloop.verify.compare import StepDiff, Tolerance

EXCEEDS = "  <-- exceeds tolerance"


def format_table(rows: Sequence[StepDiff], world: int, tol: Tolerance, mark: str = EXCEEDS) -> list[str]:
    """One line per step: both losses, the parameter and gradient differences, the worst parameter;
    ``mark`` after a step that exceeds ``tol``."""
    procs = f"loss ({world} procs)"
    lines = [f"  {'step':>4}  {'loss (1 proc)':>14}  {procs:>14}  {'max |dparam|':>12}  "
             f"{'dparam/|w|max':>13}  {'dgrad/|g|max':>12}  worst parameter"]
    for r in rows:
        mark_here = "" if not r.failures(tol) else mark
        lines.append(f"  {r.step:>4}  {r.loss_ref:>14.6f}  {r.loss_run:>14.6f}  {r.param_abs:>12.3e}  "
                     f"{r.param_rel:>13.2e}  {r.grad_rel:>12.2e}  {r.worst_param or '-'}{mark_here}")
    return lines


def equivalence_verdict(rows: Sequence[StepDiff], steps: int, world: int, strategy: str,
                        tol: Tolerance, failed_run: bool, problems: Sequence[str] = (),
                        trajectory: Optional[Sequence[StepDiff]] = None) -> tuple[bool, str]:
    """(passed, the verdict line). ``problems``: what else failed, in words (the models as built,
    the ranks' saved state); the first reason found leads the line, the others follow on their own.
    ``trajectory``: with lock-step ``rows``, the free-running comparison, whose last difference a PASS names."""
    bad = [r for r in rows if r.failures(tol)]
    reasons = ([f"from step {bad[0].step}: " + "; ".join(bad[0].failures(tol))] if bad else [])
    reasons = [p for p in problems if p.startswith("from step 0")] + reasons
    reasons += [p for p in problems if not p.startswith("from step 0")]
    if not reasons and len(rows) == steps and not failed_run:
        worst = max(rows, key=lambda r: r.param_rel)
        if tol.lockstep and trajectory:
            last = trajectory[-1]
            return True, (f"verdict: PASS - {world} processes ({strategy}) train the same model as 1 process over "
                          f"{steps} step(s), each step from the same state (lock-step: largest parameter difference "
                          f"{worst.param_rel:.1e} of the largest weight in one step; free-running: "
                          f"{last.param_rel:.1e} after {last.step})")
        return True, (f"verdict: PASS - {world} processes ({strategy}) train the same model as 1 process over "
                      f"{steps} step(s) (largest parameter difference {worst.param_rel:.1e} of the largest weight)")
    if reasons:
        return False, "verdict: FAIL - " + "\n  also: ".join(reasons)
    return False, (f"verdict: FAIL - the distributed run finished {len(rows)} of {steps} step(s)"
                   if failed_run else f"verdict: FAIL - only {len(rows)} of {steps} step(s) could be compared")


def buffer_line(rows: Sequence[StepDiff]) -> str:
    """The buffers' largest difference over the steps (empty: none differs at all, or there are none)."""
    return _worst_line(rows, "buffer_rel", "worst_buffer", "unequal_buffers", "of the largest buffer",
                       "  buffers saved with the model (compared after every step): ")


def _worst_line(rows: Sequence[StepDiff], rel: str, name: str, unequal: str, of: str, head: str) -> str:
    """The largest relative difference of one kind of tensor over the steps, and the first step where
    an exact one (a counter) differs; empty when neither."""
    worst = max(rows, key=lambda r: getattr(r, rel), default=None)
    counters = next((r for r in rows if getattr(r, unequal)), None)
    if (worst is None or not getattr(worst, rel)) and counters is None:
        return ""
    parts = ([f"largest difference {getattr(worst, rel):.2e} {of} ({getattr(worst, name)}, step "
              f"{worst.step})"] if worst is not None and getattr(worst, rel) else [])
    parts += [f"{getattr(counters, unequal)[0]} unequal from step {counters.step}"] if counters is not None else []
    return head + "; ".join(parts)


def rounding_note(rows: Sequence[StepDiff], tol: Tolerance, optimizer: str) -> str:
    """A note when parameter elements were left out for rounding-level gradients and differ beyond tolerance."""
    # Only worth saying when the gradients agree: otherwise the runs differ for a real reason.
    if (not rows or not rows[-1].excluded or rows[-1].raw_param_rel <= tol.params
            or any(not r.grad_rel <= tol.grads_at(r.step) for r in rows)):
        return ""
    last = rows[-1]
    names = ", ".join(last.excluded_in[:4]) + (", ..." if len(last.excluded_in) > 4 else "")
    return (f"  note: {last.excluded} parameter element(s) (in {names}) had gradients at rounding level, which "
            f"{optimizer} can turn into full-size steps of either sign; they are left out of the parameter "
            f"columns (with them: {last.raw_param_rel:.1e} of the largest weight). The gradients agree; "
            "a bias right before BatchNorm, whose true gradient is zero, is one such case (the running mean after "
            "it may then differ by as much: buffers are allowed the parameters' difference of the step before)")


def state_line(rows: Sequence[StepDiff]) -> str:
    """The optimizer state's largest difference after a lock-step step (empty: no state was compared or
    none differs: SGD without momentum keeps none)."""
    return _worst_line(rows, "state_rel", "worst_state", "unequal_state", "of its largest value",
                       "  optimizer state after each step (compared in lock-step): ")


def trajectory_line(rows: Sequence[StepDiff], tol: Tolerance, lockstep_passed: bool) -> str:
    """What the free-running comparison shows, beside a lock-step verdict."""
    if not rows:
        return "  trajectory: no step to compare"
    bad = next((r for r in rows if r.failures(tol)), None)
    last = rows[-1]
    if bad is None:
        return (f"  trajectory: within the free-running tolerance at every step ({last.param_rel:.1e} of the "
                f"largest weight apart after step {last.step})")
    if not lockstep_passed:   # the verdict says what differs
        return f"  trajectory: beyond the free-running tolerance from step {bad.step}"
    return (f"  trajectory: beyond the free-running tolerance from step {bad.step} ({'; '.join(bad.failures(tol))}), "
            f"while every step from the same state agrees: the runs differ by rounding that training carries "
            f"from step to step{' and ' + tol.optimizer + ' amplifies' if tol.optimizer else ''}, not in what a step does")
