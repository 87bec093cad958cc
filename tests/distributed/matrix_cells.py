"""The proof matrix (issue 53): which N-process runs scripts/matrix_runs.py makes, and their settings.

Shared by the launched script (under torchrun) and test_matrix.py (the 1-process references and
the checks). Each cell is one value of every factor in FACTORS; ``cells()`` picks them with a small
deterministic greedy pairwise algorithm, so that every pair of values of any two factors appears
in at least one cell (test_matrix.py checks that, and docs/verification.md holds their table).
"""
from __future__ import annotations

from itertools import combinations, product
from typing import Any, NamedTuple

#: factor -> its values, in order (the first value of each is the plainest)
FACTORS: dict[str, tuple[str, ...]] = {
    "strategy": ("ddp", "allreduce", "fsdp", "gpipe", "1f1b", "interleaved", "dp-tp", "fsdp-tp", "pp-dp", "hsdp"),
    "precision": ("fp32", "bf16", "fp16"),
    "clip": ("off", "on"),
    "accumulate": ("1", "2"),
    "targets": ("plain", "padded"),
    "run": ("straight", "resumed"),
    "checkpoints": ("sync", "async"),
}

#: strategy -> the settings that select it (process count: NPROC)
STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": dict(strategy="ddp"),
    "allreduce": dict(strategy="allreduce"),
    "fsdp": dict(strategy="fsdp"),
    # 2 stages, no data ranks: micro-steps of 8 (accumulate 1) or 4 (accumulate 2), cut into pieces
    "gpipe": dict(strategy="pipeline", pipeline_schedule="gpipe", microbatches=2),
    "1f1b": dict(strategy="pipeline", pipeline_schedule="1f1b", microbatches=2),
    # TinyGPT's 4 layers (embedding, 2 blocks, head) as 4 stages, 2 per process
    "interleaved": dict(strategy="pipeline", pipeline_schedule="interleaved", microbatches=4),
    "dp-tp": dict(mesh="dp=2,tp=2"),
    "fsdp-tp": dict(mesh="fsdp=2,tp=2"),
    "pp-dp": dict(mesh="pp=2,dp=2", microbatches=2, pipeline_schedule="1f1b"),
    "hsdp": dict(mesh="dp=2,fsdp=2"),
}
NPROC = {name: 4 if "mesh" in settings else 2 for name, settings in STRATEGIES.items()}
TP = ("dp-tp", "fsdp-tp")   # need strided tp (scaleloop.strategies.tensor.strided_tp_supported)

MAX_STEPS = 4
HALF = 2   # a resumed cell first stops here, then trains on in the same directory to MAX_STEPS
CLIP = 1.0  # clips: the 1-process runs with and without it part by 0.13-0.22 of the largest weight

#: what every run shares (TinyGPT; SGD: Adam's g/sqrt(v) magnifies rounding where gradients are ~0,
#: see usermodel_settings.THIRD_PARTY). 48 tokens samples (36 to train: 4.5 steps of 8) or
#: usermodels.padded_tokens (160 of 16 tokens, vocabulary of 64, -100 after a random length).
#: Steps of 8 samples: on 4 processes with accumulate 2 (and in the pipelines' pieces) a piece is
#: one sample, and the padded pieces hold different counts of real targets. (Steps of 16 take
#: about twice as long in fp16, whose matmuls are slow on the CPU.)
BASE = dict(model="tinygpt", seq_len=16, vocab_size=64, n_samples=48, test_fraction=0.25, epochs=1,
            max_steps=MAX_STEPS, batch_size=8, optimizer="sgd", lr=0.3, progress=False, tensorboard=False,
            log_every=1, device="cpu")
TARGETS = {"plain": dict(data="tokens"), "padded": dict(data="usermodels:padded_tokens")}


#: The bounds on a cell's final weights against 1 process's (largest difference over the largest
#: weight); test_matrix.py's docstring says how the factors were measured.
FP32_BOUND = 1e-6
FLOOR = 1e-6           # a reduced-precision bound is never tighter than fp32's
FSDP_FAMILY = ("fsdp", "dp-tp", "fsdp-tp", "hsdp")   # FSDP's MixedPrecisionPolicy, not autocast
FACTOR = {"autocast": 3.0, "fsdp": 6.0}               # x ddp's difference on the same settings


class Cell(NamedTuple):
    strategy: str
    precision: str
    clip: str
    accumulate: str
    targets: str
    run: str
    checkpoints: str

    @property
    def name(self) -> str:
        return "-".join(self)

    @property
    def nproc(self) -> int:
        return NPROC[self.strategy]

    @property
    def family(self) -> str:
        """How the strategy runs bf16/fp16: under autocast as 1 process, or FSDP's mixed precision."""
        return "fsdp" if self.strategy in FSDP_FAMILY else "autocast"

    @property
    def bound(self) -> str:
        """The bound on the cell's difference from 1 process, in words."""
        if self.precision == "fp32":
            return f"{FP32_BOUND:g}"
        return f"{FACTOR[self.family]:g} x ddp's"

    @property
    def numerics(self) -> tuple[str, str, str, str]:
        """What the final weights depend on besides the strategy: precision, clip, accumulate, targets."""
        return self.precision, self.clip, self.accumulate, self.targets


def pairs_of(cell: tuple[str, ...]) -> set[tuple[int, str, int, str]]:
    return {(i, cell[i], j, cell[j]) for i, j in combinations(range(len(cell)), 2)}


def all_pairs() -> set[tuple[int, str, int, str]]:
    """Every pair of values of two factors: (factor index, value, factor index, value)."""
    values = list(FACTORS.values())
    return {(i, a, j, b) for i, j in combinations(range(len(values)), 2) for a in values[i] for b in values[j]}


def cells() -> list[Cell]:
    """Greedy pairwise (AETG-like, deterministic): while a pair is uncovered, start a cell from the
    first uncovered pair (in sorted order), then give each other factor, in order, the value that
    covers the most uncovered pairs with the values chosen so far (ties: the value in the fewest
    cells so far, then the first; so the cells spread over values beyond their pairs); each
    candidate cell is then improved one factor at a time while that covers more pairs."""
    values = list(FACTORS.values())
    uncovered = all_pairs()
    chosen: list[Cell] = []
    while uncovered:
        i, a, j, b = min(uncovered, key=lambda p: (p[0], values[p[0]].index(p[1]), p[2], values[p[2]].index(p[3])))
        cell: list[str | None] = [None] * len(values)
        cell[i], cell[j] = a, b
        for k in range(len(values)):
            if cell[k] is None:
                used = [sum(c[k] == v for c in chosen) for v in values[k]]
                cell[k] = max(values[k], key=lambda v: (_gain_partial(cell, k, v, uncovered),
                                                        -used[values[k].index(v)], -values[k].index(v)))
        full = tuple(cell)
        improved = True
        while improved:   # one factor at a time, the pair that seeded the cell kept
            improved = False
            for k in range(len(values)):
                if k in (i, j):
                    continue
                for v in values[k]:
                    other = full[:k] + (v,) + full[k + 1:]
                    if len(pairs_of(other) & uncovered) > len(pairs_of(full) & uncovered):
                        full, improved = other, True
        chosen.append(Cell(*full))
        uncovered -= pairs_of(full)
    return chosen


def _gain_partial(cell: list, k: int, v: str, uncovered: set) -> int:
    return sum(((min(k, m), (v if k < m else cell[m]), max(k, m), (cell[m] if k < m else v)) in uncovered)
               for m in range(len(cell)) if m != k and cell[m] is not None)


def settings(cell: Cell, **changes: Any) -> dict[str, Any]:
    """The N-process run's settings (without ``out``); ``max_steps`` is the full run's."""
    return {**reference_settings(cell.numerics), **STRATEGIES[cell.strategy], "nproc": cell.nproc,
            "async_checkpoint": cell.checkpoints == "async", **changes}


def reference_settings(numerics: tuple[str, str, str, str]) -> dict[str, Any]:
    """The settings that the 1-process reference (and the ddp run of a reduced-precision cell) share."""
    precision, clip, accumulate, targets = numerics
    return {**BASE, **TARGETS[targets], "precision": precision, "accumulate": int(accumulate),
            "clip_grad": CLIP if clip == "on" else None}


def ddp_cell(cell: Cell) -> Cell:
    """The ddp run on the cell's processes and numerics (straight, sync) that bounds its rounding."""
    return Cell("ddp", *cell.numerics, "straight", "sync")


def runs(nproc: int, tp: bool = True) -> list[Cell]:
    """The runs of one launch of ``nproc`` processes: its cells, then the ddp runs that the
    reduced-precision cells are measured against (each once; a cell that is one already counts)."""
    mine = [c for c in cells() if c.nproc == nproc and (tp or c.strategy not in TP)]
    extra = [ddp_cell(c) for c in mine if c.precision != "fp32"]
    return mine + [c for c in dict.fromkeys(extra) if c not in mine]


def table(rows: list[Cell] | None = None) -> str:
    """The cells as a Markdown table (docs/verification.md, "The proof matrix")."""
    rows = cells() if rows is None else rows
    head = ["#", "processes", *FACTORS, "bound"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [f"| {n} | {c.nproc} | " + " | ".join(c) + f" | {c.bound} |" for n, c in enumerate(rows, 1)]
    return "\n".join(lines)


if __name__ == "__main__":   # print the table (to paste into docs/verification.md)
    print(table())
    total = list(product(*FACTORS.values()))
    print(f"\n{len(cells())} cells of {len(total)} combinations; {len(all_pairs())} pairs")
