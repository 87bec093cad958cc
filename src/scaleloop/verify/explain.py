"""``--explain``: one step, told rank by rank.

The tutorial's exercise, printing ``.grad`` on each rank, made a feature. For the chosen step
each rank reports the samples it trained on, its own loss, the first layer's gradient as its
own backward computed it (before synchronisation) and as the strategy left it (after), and
whether it writes files. Verify then does the all-reduce by hand (the sum of the ranks' local
gradients, divided by their number) to show that it is what the strategy produced, and puts
the one-process gradient of the whole batch beside it.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


def _fmt(value: Optional[float], spec: str = ".6g") -> str:
    return "-" if value is None else format(value, spec)


def format_explain(step: int, run: dict[str, Any], reference: Optional[dict[str, Any]]) -> list[str]:
    """Lines for the per-rank account of ``step`` from the distributed (and reference) records."""
    ranks: Sequence[dict[str, Any]] = run["ranks"]
    param = run.get("first_param") or "?"
    world, accumulate = run["world_size"], run["accumulate"]
    micro = [[m for m in r["micro"] if m["step"] == step] for r in ranks]
    step_samples = sum(len(m["indices"]) for ms in micro for m in ms)
    lines = [f"explain: step {step} on {world} ranks ({run['strategy']}): global batch {step_samples} = "
             f"{world} ranks x {accumulate} micro-step(s) x ~{step_samples // max(1, world * accumulate)} samples",
             f"  {'rank':>4}  {'samples (first indices)':<30}  {'local loss':>10}  "
             f"{'|grad| before sync':>18}  {'after sync':>10}  writes files"]
    for r, ms in zip(ranks, micro):
        ex = r.get("explain") or {}
        indices = [i for m in ms for i in m["indices"]]
        n = len(indices)
        loss = sum(m.get("loss", 0.0) * len(m["indices"]) for m in ms) / n if n else None
        shown = f"{n}: [" + ", ".join(str(i) for i in indices[:4]) + (", ...]" if n > 4 else "]")
        if ex.get("writes_checkpoint_shard"):
            writes = ("prints, run directory, metrics, its checkpoint shard" if ex.get("writes_files")
                      else "its checkpoint shard only")
        else:
            writes = "yes: prints, run directory, metrics, checkpoints" if ex.get("writes_files") else "no"
        lines.append(f"  {r['rank']:>4}  {shown:<30}  {_fmt(loss, '.6f'):>10}  {_fmt(ex.get('local_norm')):>18}  "
                     f"{_fmt(ex.get('synced_norm')):>10}  {writes}")
    lines.append(f"  (|grad| is the norm of {param}'s gradient: 'before sync' is what this rank's backward "
                 "computed from its own samples, 'after sync' what the strategy left in .grad)")
    ex0 = ranks[0].get("explain") or {}
    diffs = [(r.get("explain") or {}).get("synced_vs_allreduced") for r in ranks]
    if ex0.get("allreduced_norm") is None and ex0.get("synced_norm") is not None:
        lines.append(f"  ({run['strategy']} computes gradients on gathered copies of the parameters and keeps only "
                     "the reduced shard: a rank's gradient before synchronisation is not visible)")
    if ex0.get("allreduced_norm") is not None:
        agree = all(d is not None and d <= 1e-6 * max(1.0, ex0["allreduced_norm"]) for d in diffs)
        worst = max((d for d in diffs if d is not None), default=float("nan"))
        factor = ex0.get("count_factor", 1.0)
        weighed = (f" x {factor:.6g} (the step's weight over -100 padding: its samples x length / its real targets)"
                   if factor != 1.0 else "")
        lines.append(f"  all-reduce by hand: (sum of the {world} local gradients) / {world}{weighed} has norm "
                     f"{ex0['allreduced_norm']:.6g}; the synchronised gradient "
                     + ("equals it on every rank" if agree else "DIFFERS from it")
                     + f" (largest difference {worst:.1e})")
    if reference is not None:
        ref_ex = reference["ranks"][0].get("explain") or {}
        ref_loss = reference["losses"][step - 1] if len(reference["losses"]) >= step else None
        lines.append(f"  one process on the whole batch: loss {_fmt(ref_loss, '.6f')}, |grad| {_fmt(ref_ex.get('synced_norm'))}")
    return lines
