"""``--strategy fsdp`` with 2 real Gloo processes: the same model as 1 process, and what sharding adds.

- 2 processes equal 1 after 6 Adam steps (1e-5 of the weight scale, as for DDP), with
  ``--accumulate`` 1 and 2, and with ``--clip-grad`` (the global norm over all shards);
- a sharded checkpoint written by 2 processes resumes on 1, and one written by 1 on 2
  (through the CLI: ``scaleloop train --out RUN --nproc N``);
- each rank holds about half of the parameters, gradients and optimizer state (memory.json);
- a hostile sharded checkpoint (code pickled into ``.metadata`` or into the byte entries of the
  ranks' files, the manifest rewritten to match) is refused in one line on resume, and nothing
  in it runs (tests/checkpoint/test_untrusted.py has the single-process cases);
- a disk too small for the sharded checkpoint: one line naming it and the space, nothing of it
  left, the one before still the newest (a real 3 MB tmpfs);
- scripts/fsdp_probe.py: no reduce-scatter on micro-steps, fp16 skips agree across ranks,
  evaluation with uneven batch counts, the units, the full-weights export, BatchNorm buffers
  (fsdp ends with DDP's weights, buffers and test loss).

The 2-process training runs share one torchrun launch (scripts/fsdp_runs.py); the 1-process
references run in this process.
"""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from hostile import payload_bytes, payload_in_byte_entries, rewrite
from procs import run, scaleloop
from scaleloop.commands.doctor import diagnose
from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv
from scaleloop.loop.training import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# The settings of scripts/fsdp_runs.py, on one process.
SIX = dict(data="random", n_samples=1000, model="simplenet", epochs=1, max_steps=6, batch_size=64,
           optimizer="adam", lr=0.01, progress=False, tensorboard=False, log_every=1, device="cpu")


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert a.keys() == b.keys()
    scale = max(t.abs().max().item() for t in a.values())
    return max(((a[k] - b[k]).abs().max().item() / scale, k) for k in a)


def torchrun(script: str, *args: str, cwd: Path) -> str:
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / script), *args], cwd=cwd, timeout=240)
    assert res.returncode == 0, f"{script} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def sharded(root: Path) -> Path:
    """The 2-process fsdp runs of scripts/fsdp_runs.py, under ``root/fsdp2``."""
    out = root / "fsdp2"
    described = json.loads(torchrun("fsdp_runs.py", str(out), cwd=root))
    assert described["accumulate1"] == "fsdp (3 units: 2 x Linear + root)", described
    return out


@pytest.fixture(scope="module")
def single(root: Path):
    cache: dict[str, Path] = {}

    def get(name: str, **changes) -> Path:
        if name not in cache:
            cfg = TrainConfig(**{**SIX, **changes, "out": str(root / "single" / name)}).validate()
            # One thread, as each torchrun worker has (OMP_NUM_THREADS=1): the reference then does
            # not depend on what an earlier test left torch's thread count at.
            before = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                cache[name] = train(cfg, DistEnv(), log=lambda _msg: None).run_dir
            finally:
                torch.set_num_threads(before)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["accumulate1", "accumulate2"])
def test_two_processes_equal_one(sharded: Path, single, name: str) -> None:
    diff, key = max_rel_diff(weights(single("plain")), weights(sharded / name))
    assert diff <= 1e-5, f"fsdp x2 ({name}) differs from 1 process at {key}: {diff:.2e}"


def test_clipping_uses_the_global_norm(sharded: Path, single) -> None:
    clipped = single("clip", clip_grad=0.05)
    active, _ = max_rel_diff(weights(single("plain")), weights(clipped))
    assert active > 1e-3, "--clip-grad did not clip: the test would not catch a per-shard norm"
    diff, key = max_rel_diff(weights(clipped), weights(sharded / "clip"))
    assert diff <= 1e-5, f"fsdp x2 --clip-grad --accumulate 2 differs from 1 process at {key}: {diff:.2e}"


def test_each_rank_holds_half_of_the_parameters_gradients_and_optimizer_state(sharded: Path, single) -> None:
    whole = json.loads((single("plain") / "memory.json").read_text())["ranks"][0]
    ranks = json.loads((sharded / "accumulate1" / "memory.json").read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sum(r["parameters"] for r in ranks) == whole["parameters"] == ranks[0]["model_parameters"]
    for r in ranks:
        for kind in ("parameters", "gradients", "optimizer"):
            share = r[kind] / whole[kind]
            assert 0.4 <= share <= 0.6, f"rank {r['rank']} holds {share:.0%} of the {kind}"


def shard_files(step: Path) -> set[str]:
    files = set(json.loads((step / "manifest.json").read_text())["files"])
    assert {".metadata", "state.pt"} <= files, files
    return {f for f in files if f.endswith(".distcp")}


def test_resume_two_processes_on_one(root: Path, sharded: Path, single) -> None:
    out = sharded / "first-half"
    assert shard_files(out / "checkpoints" / "step-00000003") == {"__0_0.distcp", "__1_0.distcp"}
    log = scaleloop(["train", "--out", str(out), "--max-steps", "6", "--nproc", "1"], cwd=root).stdout
    assert "written by 2 process(es), this run has 1" in log
    diff, key = max_rel_diff(weights(single("plain")), weights(out))
    assert diff <= 1e-5, f"fsdp 2 -> 1 resume differs at {key}: {diff:.2e}"


def test_resume_one_process_on_two(root: Path, single) -> None:
    out = root / "fsdp1-fsdp2"
    train(TrainConfig(**{**SIX, "max_steps": 3, "strategy": "fsdp", "out": str(out)}).validate(), DistEnv(),
          log=lambda _msg: None)
    assert shard_files(out / "checkpoints" / "step-00000003") == {"__0_0.distcp"}
    log = scaleloop(["train", "--out", str(out), "--max-steps", "6", "--nproc", "2"], cwd=root).stdout
    assert "written by 1 process(es), this run has 2" in log
    assert "fsdp (3 units: 2 x Linear + root)" in log and "memory per rank (tensor bytes" in log  # the summary's table
    diff, key = max_rel_diff(weights(single("plain")), weights(out))
    assert diff <= 1e-5, f"fsdp 1 -> 2 resume differs at {key}: {diff:.2e}"


@pytest.mark.parametrize("where", [".metadata", "byte entries"])
def test_a_hostile_checkpoint_is_refused_in_one_line_and_runs_nothing(root: Path, sharded: Path, where: str) -> None:
    # first-half: 2 processes' checkpoint of step 3 (and step 6 from 1 process, once resumed above)
    out, marker = root / f"hostile-{where.replace(' ', '-')}", root / f"ran-{where.replace(' ', '-')}"
    shutil.copytree(sharded / "first-half", out)
    for step in (out / "checkpoints").glob("step-*"):
        if where == ".metadata":
            rewrite(step, ".metadata", payload_bytes(marker))
        else:
            assert payload_in_byte_entries(step, marker) > 0
    res = run([sys.executable, "-m", "scaleloop", "train", "--out", str(out), "--max-steps", "12", "--nproc", "2"],
              cwd=root, timeout=240)
    assert res.returncode == 2 and not marker.exists(), res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("scaleloop: error:")]
    assert len(errors) == 1 and "Traceback" not in res.stdout + res.stderr, res.stderr
    if where == ".metadata":   # refused by the launcher's check, before a worker starts
        assert "every checkpoint in" in errors[0] and "failed verification" in errors[0], errors
        assert "/.metadata': it asks to run or build io.open" in res.stderr and "launching" not in res.stderr
    else:   # refused by the ranks' DCP load, on the first byte entry met
        assert re.search(r"refusing to load '.*/step-\d+/__[01]_0\.distcp': its entry 'optimizer\.param_groups",
                         errors[0]), errors
        assert json.loads((out / "failure.json").read_text())["kind"] == "usage"


def test_probe(root: Path) -> None:
    report = json.loads(torchrun("fsdp_probe.py", cwd=root))
    assert report["accumulate"] == {"no_grad_after_first": True, "grad_after_last": True}
    skipped, stepped = report["fp16"][0]
    assert not skipped["stepped"] and stepped["stepped"] and stepped["scale"] == skipped["scale"]
    assert set(report["evaluate"]) == {"3", "1"}
    assert report["convnet_fsdp_vs_ddp"]["weights"] <= 1e-6


def test_a_full_disk_is_one_line_and_keeps_the_checkpoint_before(small_disk: Path) -> None:
    # Before: DCP's exception (a BaseException) passed the rank's error record, its report went to
    # the full disk, and the launcher said "no Python error"; a .tmp-step-... stayed on the disk.
    run_dir = small_disk / "run"
    res = run([sys.executable, "-m", "scaleloop", "train", "--nproc", "2", "--strategy", "fsdp", "--data", "random",
               "--hidden-dim", "8192", "--checkpoint-every", "5", "--max-steps", "12", "--no-progress",
               "--no-tensorboard", "--out", str(run_dir)], cwd=small_disk.parent, timeout=240)
    root = run_dir / "checkpoints"
    assert res.returncode == 2, res.stdout + res.stderr
    assert re.fullmatch(
        rf"scaleloop: error: cannot write '{root}/step-00000010': disk full \(it needs 2\.\d MB, [\d.]+ KB free\); "
        rf"the newest valid checkpoint is '{root}/step-00000005' \(step 5\); once space is freed, continue with: "
        rf"scaleloop train --out {run_dir}\n", res.stderr), res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000005"]
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["kind"] == "unwritable" and "disk full" in failure["message"]
    told = diagnose(run_dir)
    assert told.state == "unwritable" and "disk full" in told.what and told.checkpoint.step == 5
