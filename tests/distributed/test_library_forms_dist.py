"""The library forms users know, on 2 processes, under every strategy (issue 52, point 6):

- ``strategy.setup(model, optimizer_object)`` trains as the factory form does: bit for bit the same
  weights under ddp, allreduce, fsdp, the pipeline and ``--mesh`` tp=2 and dp=2, and those equal
  1 process within 1e-6 of the largest weight (SGD with momentum; two parameter groups with their
  own hyper-parameters, one for the pipeline, which takes one); each rank's optimizer holds exactly
  the parameters it trains (FSDP's DTensors, its pipeline stage's);
- ``strategy.loader(DataLoader(...))`` takes the DataLoader's dataset, its batch size as the global
  batch and its collate function: the same weights as 1 process given the same DataLoader.

One torchrun launch runs every cell (scripts/library_forms.py); the 1-process references run here.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from procs import run
from scaleloop.runtime.dist import DistEnv

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import library_forms  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TOLERANCE = 1e-6   # of the largest weight


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    scale = max(t.abs().max().item() for t in a.values())
    return max(((a[k] - b[k]).abs().max().item() / scale, k) for k in a)


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("library_forms")
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / "library_forms.py"), str(root / "cells.pt")], cwd=root, timeout=240)
    assert res.returncode == 0, f"library_forms.py failed ({res.returncode}):\n{res.stdout}\n{res.stderr[-4000:]}"
    return torch.load(root / "cells.pt", weights_only=True)


@pytest.fixture(scope="module")
def cells(launched: dict[str, dict]) -> dict[str, dict[str, torch.Tensor]]:
    return launched["weights"]


@pytest.fixture(scope="module")
def single():
    cache: dict[tuple, dict[str, torch.Tensor]] = {}

    def get(two_groups: bool, data: str = "dataset", accumulate: int = 1) -> dict[str, torch.Tensor]:
        key = (two_groups, data, accumulate)
        if key not in cache:   # the known path: one process, the factory form
            cache[key], _ = library_forms.train_cell("single", DistEnv(), form="factory", data=data,
                                                     two_groups=two_groups, accumulate=accumulate)
        return cache[key]

    return get


def initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return library_forms.Net().state_dict()


@pytest.mark.parametrize("cell", list(library_forms.STRATEGIES))
def test_the_optimizer_object_trains_as_the_factory_and_as_one_process(launched, cells, single, cell: str) -> None:
    # Each rank's optimizer holds exactly the parameters it trains (a pipeline stage's own only).
    assert launched["holds"][f"{cell}/object"] == [True, True]
    assert launched["holds"][f"{cell}/factory"] == [True, True]
    two = library_forms.STRATEGIES[cell][2]
    reference = single(two)
    moved, _ = max_rel_diff(initial(), reference)
    assert moved > 0.05, f"the reference hardly trained ({moved:.3f} of the largest weight)"
    obj, factory = cells[f"{cell}/object"], cells[f"{cell}/factory"]
    diff, key = max_rel_diff(reference, factory)
    assert diff <= TOLERANCE, f"{cell} (factory) differs from 1 process at {key}: {diff:.2e}"
    diff, key = max_rel_diff(reference, obj)
    assert diff <= TOLERANCE, f"{cell} (optimizer object) differs from 1 process at {key}: {diff:.2e}"
    for k in obj:
        assert torch.equal(obj[k], factory[k]), f"{cell}: the optimizer object's {k} differs from the factory's"


@pytest.mark.parametrize("cell", list(library_forms.DATALOADER))
def test_a_dataloader_gives_dataset_global_batch_and_collate(cells, single, cell: str) -> None:
    base, accumulate = library_forms.DATALOADER[cell]
    two = library_forms.STRATEGIES[base][2]
    reference = single(two, "dataloader", accumulate)
    diff, key = max_rel_diff(reference, cells[cell])
    assert diff <= TOLERANCE, f"{cell} differs from 1 process at {key}: {diff:.2e}"
    # Its collate function was used: the same run on undoubled inputs ends elsewhere.
    undoubled, _ = max_rel_diff(reference, single(two, "dataset", 1))
    assert undoubled > 1e-3
