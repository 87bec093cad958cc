"""What ``scaleloop verify`` was asked to check, as one value that travels to the workers.

No torch here: the CLI builds these while ``scaleloop --help`` must stay fast.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from scaleloop.errors import UsageError

CHECKS = ("equivalence", "sync", "data")
DEFAULT_STEPS = 5


@dataclass(frozen=True)
class VerifyOptions:
    """The verify-only settings (the model, data and launch come from ``TrainConfig``).

    ``checks`` is a subset of ``CHECKS``; ``explain_step`` (1-based) asks for the per-rank
    account of that step; ``loss`` is a user loss ``pkg.module:fn``; ``tolerance`` overrides
    the parameter tolerance; ``report`` keeps every recorded file in that directory; ``plot``
    is where the picture of the comparison goes (``report/verify.png`` with a report anyway).
    """

    steps: int = DEFAULT_STEPS
    checks: tuple[str, ...] = ("equivalence",)
    explain_step: Optional[int] = None
    tolerance: Optional[float] = None
    report: Optional[str] = None
    plot: Optional[str] = None

    def validate(self) -> "VerifyOptions":
        """Raise UsageError naming the flag when a value cannot work."""
        if self.steps < 1:
            raise UsageError("--steps must be a positive integer")
        unknown = [c for c in self.checks if c not in CHECKS]
        if unknown or not self.checks:
            raise UsageError(f"--check {','.join(unknown) or '(none)'}: choose from {', '.join(CHECKS)} or all")
        if self.explain_step is not None and not 1 <= self.explain_step <= self.steps:
            raise UsageError(f"--explain {self.explain_step}: the step to explain must be in 1..{self.steps} "
                             f"(--steps {self.steps})")
        if self.tolerance is not None and not self.tolerance > 0:
            raise UsageError("--tolerance must be a positive number")
        return self

    @property
    def hashes_replicas(self) -> bool:
        """Whether the ranks hash their tensors at the end: for ``--check sync``, and for equivalence,
        where a rank whose saved state differs from rank 0's fails the run."""
        return "sync" in self.checks or "equivalence" in self.checks

    @property
    def lockstep(self) -> bool:
        """Whether the distributed run saves its state at every step for the lock-step comparison
        (``verify.lockstep``): for equivalence, which it decides."""
        return "equivalence" in self.checks

    @property
    def needs_reference(self) -> bool:
        """Whether a one-process reference run is needed (for comparing, or for explaining a step)."""
        return "equivalence" in self.checks or self.explain_step is not None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "VerifyOptions":
        raw = json.loads(text)
        raw["checks"] = tuple(raw["checks"])
        return cls(**raw)

    def write(self, path: Path) -> None:
        path.write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def read(cls, path: Path) -> "VerifyOptions":
        return cls.from_json(path.read_text(encoding="utf-8"))


def parse_checks(values: Optional[list[str]]) -> tuple[str, ...]:
    """``--check`` values (repeatable, comma-separated, or ``all``) as an ordered tuple."""
    if not values:
        return ("equivalence",)
    picked: list[str] = []
    for value in values:
        for item in value.split(","):
            item = item.strip().lower()
            names = CHECKS if item == "all" else (item,)
            for name in names:
                if name not in CHECKS:
                    raise UsageError(f"--check {item!r} is not one of: {', '.join(CHECKS)}, all")
                if name not in picked:
                    picked.append(name)
    return tuple(c for c in CHECKS if c in picked)
