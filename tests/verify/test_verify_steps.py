"""The verify training steps and recorder, in one process: the same steps as ``scaleloop train``."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scaleloop.config import TrainConfig
from scaleloop.data.sampler import StepSampler
from scaleloop.runtime.dist import DistEnv
from scaleloop.loop.training import train
import scaleloop
from scaleloop.verify.explain import format_explain
from scaleloop.verify.recorder import RECORD_FILE, Recorder, failure_file, step_file
from scaleloop.verify.steps import RunSpec, run_steps
from scaleloop.verify.sync import check_sync, format_sync

CFG = TrainConfig(data="random", n_samples=96, model="simplenet", hidden_dim=16, batch_size=32,
                  device="cpu", progress=False, tensorboard=False, checkpoints=False, epochs=2, lr_schedule="cosine")


def record(run_dir: Path) -> dict:
    return json.loads((run_dir / RECORD_FILE).read_text())


def test_steps_reproduce_scaleloop_train_exactly(tmp_path: Path) -> None:
    # 96 samples / 32 = 3 steps per epoch: step 4 is in the second epoch. The same config for
    # both, so that the cosine schedule spans the same 4 steps.
    cfg = CFG.replace(max_steps=4)
    run_steps(cfg, DistEnv(), RunSpec("single", 1, 4), Recorder(DistEnv(), tmp_path / "v"))
    train(cfg.replace(out=str(tmp_path / "t")), DistEnv(), log=lambda _m: None)
    trained = torch.load(tmp_path / "t" / "model.pt", weights_only=True)
    verified = torch.load(step_file(tmp_path / "v", 4), weights_only=True)["params"]
    assert trained.keys() == verified.keys()
    for name in trained:
        assert torch.equal(trained[name], verified[name]), name


def test_recorder_writes_steps_losses_samples_and_gradients(tmp_path: Path) -> None:
    run_steps(CFG, DistEnv(), RunSpec("single", 2, 3), Recorder(DistEnv(), tmp_path, explain_step=2, audit_data=True,
                                                               check_sync=True))
    rec = record(tmp_path)
    assert rec["steps_done"] == 3 and len(rec["losses"]) == 3 and rec["accumulate"] == 2
    assert rec["first_param"] == "net.0.weight" and rec["n_samples"] == 96
    (rank,) = rec["ranks"]
    sampler = StepSampler(96, 32, accumulate=2, seed=0)
    want = [mb.indices.tolist() for mb in sampler.micro_batches(0)]
    assert [m["indices"] for m in rank["micro"]] == want  # 3 steps x 2 micro-steps, in order
    assert [m["indices"] for m in rank["audit"]] == want  # one whole epoch audited
    assert all(v == [] for v in rank["no_grad"].values())
    saved = torch.load(step_file(tmp_path, 2), weights_only=True)
    assert saved["grads"].keys() == saved["params"].keys() and saved["grads"]["net.0.weight"].abs().sum() > 0
    ex = rank["explain"]
    # One process: its local gradient is the synchronised one and the all-reduced one.
    assert ex["local_norm"] == pytest.approx(ex["synced_norm"], rel=1e-6) == pytest.approx(ex["allreduced_norm"])
    assert ex["writes_files"] is True
    lines = format_explain(2, rec, rec)
    assert "equals it on every rank" in lines[-2] and lines[-1].startswith("  one process on the whole batch")
    assert rec["sync"]["diverging"] == [] and format_sync(rec["sync"], 3)[0]


def test_failure_is_recorded_with_what_was_known(tmp_path: Path) -> None:
    recorder = Recorder(DistEnv(), tmp_path)
    strategy = scaleloop.strategy("single", DistEnv())
    recorder.attach(strategy, torch.nn.Linear(2, 1))
    recorder.fail(RuntimeError("Expected to have finished reduction"))
    failure = json.loads(failure_file(tmp_path, 0).read_text())
    assert failure["error"] == "RuntimeError: Expected to have finished reduction" and failure["step"] == 1


def test_sync_report_names_the_first_diverging_tensor() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    result = check_sync(scaleloop.strategy("single", DistEnv()), model)
    assert result is not None and result["parameters"] == 4 and result["buffers"] == 3 and result["diverging"] == []
    result["diverging"] = [{"name": "1.running_mean", "kind": "buffer", "ranks": [1], "max_abs": [[1, 0.25]]},
                           {"name": "1.running_var", "kind": "buffer", "ranks": [1]}]
    passed, lines = format_sync(result, 3)
    assert not passed
    assert "first diverging tensor: 1.running_mean (buffer) on rank 1" in lines[1] and "0.25" in lines[1]
    assert "only buffers differ" in lines[3]
