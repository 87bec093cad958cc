"""Verify trains exactly what ``scaleloop train`` trains: the same weights, bit for bit, after K steps.

For each strategy, ``scaleloop verify --report DIR --steps K`` saves every parameter after
step K (``step-000K.pt``, rank 0, the whole model under the user's module's names), and
``scaleloop train --max-steps K`` with the same settings writes ``model.pt``: every parameter
must be ``torch.equal``. ``single`` is verify's one-process reference (of the ddp run) against
``train --strategy single``; ddp, fsdp and pipeline are verify's 2-process runs against
``train --nproc 2``. Each side is a real command in child processes (``procs.run``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from procs import run, scaleloop
from scaleloop.verify.dirs import distributed_dir, reference_dir
from scaleloop.verify.recorder import step_file

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

K = 3
SETTINGS = ["--model", "simplenet", "--data", "digits", "--batch-size", "64", "--seed", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def verified(tmp_path_factory: pytest.TempPathFactory):
    """``strategy -> verify's step-K parameters``; each 2-process verify run happens once."""
    root = tmp_path_factory.mktemp("verify")
    done: dict[str, dict[str, torch.Tensor]] = {}

    def params(strategy: str) -> dict[str, torch.Tensor]:
        if strategy not in done:
            # The one-process reference of any verify run is strategy single's run: the ddp one's.
            launched = "ddp" if strategy == "single" else strategy
            report = root / launched
            if not report.exists():
                res = run([sys.executable, "-m", "scaleloop.verify", *SETTINGS, "--strategy", launched,
                           "--nproc", "2", "--steps", str(K), "--report", str(report)], cwd=root, timeout=240)
                assert res.returncode == 0, f"verify {launched}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
                assert f"verdict: PASS - 2 processes ({launched})" in res.stdout, res.stdout
            side = reference_dir(report) if strategy == "single" else distributed_dir(report)
            done[strategy] = torch.load(step_file(side, K), weights_only=True)["params"]
        return done[strategy]

    return params


@pytest.mark.parametrize("strategy, nproc", [("single", 1), ("ddp", 2), ("fsdp", 2), ("pipeline", 2)])
def test_verify_ends_bitwise_equal_to_train(verified, strategy: str, nproc: int, tmp_path: Path) -> None:
    mine = verified(strategy)
    out = tmp_path / "run"
    scaleloop(["train", *SETTINGS, "--strategy", strategy, "--nproc", str(nproc), "--max-steps", str(K),
               "--no-checkpoints", "--no-progress", "--out", str(out)], cwd=tmp_path, timeout=240)
    trained = torch.load(out / "model.pt", weights_only=True)
    assert set(mine) <= set(trained), f"verify saved parameters train does not have: {set(mine) - set(trained)}"
    assert len(mine) == 4  # simplenet: two Linear layers
    differ = {name: float((mine[name].double() - trained[name].double()).abs().max())
              for name in mine if not torch.equal(mine[name], trained[name])}
    assert not differ, f"{strategy}: verify's step-{K} parameters differ from train --max-steps {K}'s: {differ}"
