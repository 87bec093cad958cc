"""The proof matrix (issue 53): N processes train what 1 process trains, across the factors together.

Each cell of matrix_cells.cells() picks one value of every factor: the strategy (ddp, allreduce,
fsdp, the gpipe, 1f1b and interleaved pipelines on 2 processes; the ``--mesh`` layouts dp x tp,
fsdp x tp, pp x dp and hsdp on 4), the precision (fp32, bf16, fp16), clipping (off, on), the
accumulation (1, 2), the targets (plain, -100 padding), the run (straight, or resumed from its
checkpoint at step 2 of 4) and the checkpoints (synchronous, async). The cells cover every pair of
values of any two factors (greedy pairwise; checked below). Each cell's final weights are compared
with a 1-process run of the same precision, clipping, accumulation and targets, as the largest
difference over the largest weight:

- fp32: at most FP32_BOUND (1e-6; measured: at most 1.2e-7 in every cell);
- bf16 and fp16 round every matmul, and a split batch rounds differently from a whole one. Each
  such cell is measured against ddp on the same processes, precision, clipping, accumulation and
  targets (matrix_cells.ddp_cell, run in the same launch): its difference from 1 process must be
  at most ``FACTOR[cell.family] x ddp's`` (and never under FLOOR, 1e-6). The factors come from a
  sweep of every strategy over all 16 reduced-precision settings (straight runs of these 4 steps,
  on the 2-core CPU machine; ddp's own difference: up to 1.0e-3 in bf16, 1.7e-4 in fp16):
  - "autocast", 3x: the strategies that autocast as 1 process does. allreduce measured 1.00x
    (ddp's arithmetic); the pipelines (gpipe, 1f1b, interleaved, pp x dp) at most 1.39x: each
    piece's gradient rounds on its own before they are added, as each ddp rank's does, so
    microbatches > 1 need no bound of their own.
  - "fsdp", 6x: fsdp and the meshes dp x tp, fsdp x tp and hsdp, whose bf16/fp16 is FSDP's
    MixedPrecisionPolicy, not autocast (docs/strategies.md, "Mixed precision"): the whole forward
    in bf16/fp16 parameters, another rounding recipe than 1 process's. Measured at most 3.41x (fp16,
    the tp meshes). One process under that recipe (a one-rank FSDP group) already differs from 1
    process under autocast by 1.2-2.4x ddp's difference; measured against it, 2 fsdp processes and
    hsdp stay within 2.1x ddp's and the tp meshes within 2.5x (tp splits the matmuls).

The table of the cells and their bounds is in docs/verification.md ("The proof matrix").

The N-process runs share one torchrun launch per process count (scripts/matrix_runs.py); the
1-process references run in this process, once per distinct settings.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import matrix_cells
from matrix_cells import FACTOR, FACTORS, FLOOR, FP32_BOUND, Cell, all_pairs, cells, ddp_cell, pairs_of, table
from procs import run
from weights import max_rel_diff, weights
from scaleloop.config import TrainConfig
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.tensor import strided_tp_supported

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "verification.md"
CELLS = cells()
TP_OK = strided_tp_supported()


DESCRIBED = {"ddp": "ddp", "allreduce": "allreduce", "fsdp": "fsdp (", "gpipe": "pipeline (2 stages, 2 micro",
             "1f1b": "pipeline (2 stages, 2 micro-batch(es), 1F1B)",
             "interleaved": "pipeline (4 stages, 2 per process, 4 micro-batch(es), interleaved 1F1B)",
             "dp-tp": "mesh dp=2,tp=2 (replicated x tp", "fsdp-tp": "mesh fsdp=2,tp=2 (fsdp x tp",
             "pp-dp": "pipeline (2 stages x 2 replicas, 2 micro-batch(es), 1F1B)", "hsdp": "mesh dp=2,fsdp=2 (hsdp"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("matrix")


@pytest.fixture(scope="module")
def launched(root: Path):
    """nproc -> the runs of scripts/matrix_runs.py on that many processes (one launch each, made
    when a test first needs it), under ``root/n<nproc>``."""
    cache: dict[int, dict] = {}

    def get(nproc: int) -> dict:
        if nproc not in cache:
            out = root / f"n{nproc}"
            out.mkdir()
            res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                       str(SCRIPTS / "matrix_runs.py"), str(out)], cwd=root, timeout=300)
            assert res.returncode == 0, f"matrix_runs.py on {nproc} failed ({res.returncode}):\n{res.stdout}\n" \
                                        f"{res.stderr[-4000:]}"
            cache[nproc] = json.loads(res.stdout.strip().splitlines()[-1])
        return cache[nproc]

    return get


@pytest.fixture(scope="module")
def single(root: Path):
    """numerics -> the 1-process run of those settings (each once)."""
    cache: dict[tuple, Path] = {}

    def get(numerics: tuple[str, str, str, str]) -> Path:
        if numerics not in cache:
            cfg = TrainConfig(**matrix_cells.reference_settings(numerics),
                              out=str(root / "single" / "-".join(numerics))).validate()
            # One thread, as each torchrun worker has (OMP_NUM_THREADS=1); usermodels.py importable.
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            sys.path.insert(0, str(SCRIPTS))
            try:
                with pytest.MonkeyPatch.context() as patch:   # no curves.png (as scripts/matrix_runs.py)
                    patch.setattr("scaleloop.loop.result.plot_curves", lambda *_args: None)
                    cache[numerics] = train(cfg, DistEnv(), log=lambda _msg: None).run_dir
            finally:
                sys.path.remove(str(SCRIPTS))
                torch.set_num_threads(before)
        return cache[numerics]

    return get


def test_the_cells_cover_every_pair_of_values() -> None:
    pairs = set().union(*(pairs_of(c) for c in CELLS))
    assert pairs == all_pairs(), sorted(all_pairs() - pairs)[:5]
    assert len(set(CELLS)) == len(CELLS) == 30   # 10 strategies x 3 precisions: the fewest possible
    assert cells() == CELLS                      # deterministic
    for cell in CELLS:
        assert all(value in FACTORS[factor] for factor, value in zip(FACTORS, cell)), cell


def test_the_table_in_the_docs_is_the_cells() -> None:
    # (regenerate it with `python tests/distributed/matrix_cells.py`)
    assert table() in DOCS.read_text(), "docs/verification.md's table of the proof matrix is not the cells"


@pytest.mark.parametrize("targets", ["plain", "padded"])
def test_clipping_clips(single, targets: str) -> None:
    # matrix_cells.CLIP really clips: with and without it, 1 process ends elsewhere.
    diff, key = max_rel_diff(weights(single(("fp32", "off", "1", targets))),
                             weights(single(("fp32", "on", "1", targets))))
    assert diff > 1e-3, f"clip_grad={matrix_cells.CLIP} changes nothing ({diff:.2e} at {key})"


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.name, marks=pytest.mark.skipif(
    c.strategy in matrix_cells.TP and not TP_OK, reason="tp of a fused q/k/v needs torch 2.13+")) for c in CELLS])
def test_n_processes_equal_one(root: Path, launched, single, cell: Cell) -> None:
    described = launched(cell.nproc)
    got = described[cell.name]
    assert got["strategy"].startswith(DESCRIBED[cell.strategy]), got["strategy"]
    assert got["steps"] == matrix_cells.MAX_STEPS, got
    if cell.run == "resumed":
        assert len(got["resumed"]) == 1 and f"(global step {matrix_cells.HALF}:" in got["resumed"][0], got
    else:
        assert got["resumed"] == [], got
    out = root / f"n{cell.nproc}" / cell.name
    # its checkpoints, written in the background with async: step 2's the resumed run continued from
    steps = {matrix_cells.MAX_STEPS} | ({matrix_cells.HALF} if cell.run == "resumed" else set())
    assert {p.name for p in (out / "checkpoints").glob("step-*")} == {f"step-{s:08d}" for s in steps}
    reference = weights(single(cell.numerics))
    diff, key = max_rel_diff(reference, weights(out))
    if cell.precision == "fp32":
        bound, why = FP32_BOUND, "fp32"
    else:
        ddp, _ = max_rel_diff(reference, weights(root / f"n{cell.nproc}" / ddp_cell(cell).name))
        factor = FACTOR[cell.family]
        bound, why = max(factor * ddp, FLOOR), f"{factor:g} x ddp's {ddp:.2e}"
    print(f"{cell.name}: {diff:.2e} of the largest weight (bound {bound:.2e}: {why})")
    assert diff <= bound, f"{cell.name} differs from 1 process by {diff:.2e} at {key}, over {bound:.2e} ({why})"
