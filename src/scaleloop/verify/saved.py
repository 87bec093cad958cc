"""The state a run saves, checked beyond the step table: the models as built, and every rank's copy at the end.

- Step 0: rank 0's model as built (before the strategy copies rank 0's weights to every rank)
  against the reference's, and every rank's against rank 0's (by SHA-256).
- The end: every rank's parameters and buffers against rank 0's (``sync.check_sync``'s
  hashes). A rank whose state differs trains, or saves, another model than rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from scaleloop.verify.compare import InitialDiff, Tolerance, initial_diff


@dataclass(frozen=True)
class SavedState:
    """What the runs recorded about their models as built and their ranks' final copies."""

    initial: Optional[InitialDiff]            # rank 0 vs the reference, at step 0 (None: not recorded)
    initial_per_rank: list[dict[str, Any]] = field(default_factory=list)   # {"rank", "names"} per rank != rank 0
    diverging: list[dict[str, Any]] = field(default_factory=list)          # sync.check_sync's, at the end
    steps_done: int = 0

    @classmethod
    def load(cls, ref_dir: Path, run_dir: Path, run: Optional[dict[str, Any]]) -> "SavedState":
        run = run or {}
        sync = run.get("sync") or {}
        return cls(initial_diff(ref_dir, run_dir), list(run.get("initial_diverging") or []),
                   list(sync.get("diverging") or []), int(run.get("steps_done") or 0))

    def initial_differs(self, tol: Tolerance) -> bool:
        return self.initial is not None and self.initial.differs(tol)

    def problems(self, tol: Tolerance) -> list[str]:
        """What fails, in words: the step-0 difference from the reference, the ranks that end apart."""
        out = []
        if self.initial_differs(tol):
            init = self.initial
            assert init is not None
            what = (f"parameters differ from 1 process's by {init.param_rel:.2e} of the largest weight"
                    if init.param_rel > tol.params else "buffers differ from 1 process's")
            out.append(f"from step 0 (the models as built, before any step): rank 0's initial {what}, "
                       f"worst {init.worst()}")
        if self.diverging:
            first = self.diverging[0]
            out.append(f"rank {first['ranks'][0]}'s saved state differs from rank {first.get('base', 0)}'s after "
                       f"{self.steps_done} step(s): {first['name']} ({first['kind']})"
                       + (f" and {len(self.diverging) - 1} more tensor(s)" if len(self.diverging) > 1 else ""))
        return out

    def note(self, failed: bool) -> str:
        """When only other ranks built a different model, and the strategy's copy of rank 0's
        weights hid it: said, as a loop without that copy would train N different models."""
        if failed or not self.initial_per_rank or self.diverging:
            return ""
        ranks = ", ".join(str(e["rank"]) for e in self.initial_per_rank)
        first = self.initial_per_rank[0]["names"][:1]
        return (f"  note: rank(s) {ranks} built other initial weights than rank 0 ({', '.join(first)} first); the "
                "strategy copies rank 0's to every rank before the first step, so this run is unaffected, but a "
                "loop that does not would train different models: seed before building the model")

    def replica_buffers(self) -> list[str]:
        """The buffers that ended apart between the ranks (empty when any parameter did too)."""
        if any(d["kind"] != "buffer" for d in self.diverging):
            return []
        return [d["name"] for d in self.diverging]
