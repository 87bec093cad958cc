"""The equivalence table and its verdict, as printed lines."""
from __future__ import annotations

from typing import Sequence

from scaleloop.verify.compare import StepDiff, Tolerance


def format_table(rows: Sequence[StepDiff], world: int, tol: Tolerance) -> list[str]:
    """One line per step: both losses, the parameter and gradient differences, the worst parameter."""
    procs = f"loss ({world} procs)"
    lines = [f"  {'step':>4}  {'loss (1 proc)':>14}  {procs:>14}  {'max |dparam|':>12}  "
             f"{'dparam/|w|max':>13}  {'dgrad/|g|max':>12}  worst parameter"]
    for r in rows:
        mark = "" if not r.failures(tol) else "  <-- exceeds tolerance"
        lines.append(f"  {r.step:>4}  {r.loss_ref:>14.6f}  {r.loss_run:>14.6f}  {r.param_abs:>12.3e}  "
                     f"{r.param_rel:>13.2e}  {r.grad_rel:>12.2e}  {r.worst_param or '-'}{mark}")
    return lines


def equivalence_verdict(rows: Sequence[StepDiff], steps: int, world: int, strategy: str,
                        tol: Tolerance, failed_run: bool) -> tuple[bool, str]:
    """(passed, the verdict line)."""
    bad = [r for r in rows if r.failures(tol)]
    if not bad and len(rows) == steps and not failed_run:
        worst = max(rows, key=lambda r: r.param_rel)
        return True, (f"verdict: PASS - {world} processes ({strategy}) train the same model as 1 process over "
                      f"{steps} step(s) (largest parameter difference {worst.param_rel:.1e} of the largest weight)")
    if bad:
        first = bad[0]
        return False, f"verdict: FAIL - from step {first.step}: " + "; ".join(first.failures(tol))
    return False, (f"verdict: FAIL - the distributed run finished {len(rows)} of {steps} step(s)"
                   if failed_run else f"verdict: FAIL - only {len(rows)} of {steps} step(s) could be compared")


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
            "a bias right before BatchNorm, whose true gradient is zero, is one such case")
