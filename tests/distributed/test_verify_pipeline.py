"""``scaleloop verify --strategy pipeline``: 2 stages against 1 process, step by step.

TinyGPT's tied embedding and head lie on different stages: the recorder gathers both stages'
parameters and gradients to rank 0 under the model's own names, so the step table compares the
whole model; the loss comes from the last stage. What cannot apply to a pipeline (--explain's
per-rank all-reduce, replicas to hash) is said in the output.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from procs import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# Issue 28's false alarm: with the default Adam these settings failed free-running (4.31e-05 apart
# after 2 steps against an allowance of 4.0e-05, "no known cause found") on correct code; lock-step
# decides now, and the free-running trajectory is shown beside it.
TINYGPT = ["--model", "tinygpt", "--data", "tokens", "--n-samples", "256", "--batch-size", "16",
           "--steps", "2", "--device", "cpu", "--strategy", "pipeline", "--nproc", "2"]


def test_tinygpt_pipeline_equals_one_process_and_says_what_does_not_apply(tmp_path: Path) -> None:
    report = tmp_path / "report"
    res = run([sys.executable, "-m", "scaleloop.verify", *TINYGPT, "--check", "all", "--explain", "2",
               "--report", str(report)], cwd=tmp_path, timeout=240)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    out = res.stdout
    assert "distributed: 2 processes (pipeline), one stage of the model each" in out
    assert ("verdict: PASS - 2 processes (pipeline) train the same model as 1 process over 2 step(s), each step "
            "from the same state (lock-step: ") in out, out
    assert out.index("lock-step (decides the verdict)") < out.index("  step   loss") < out.index("trajectory (shown")
    table = out[out.index("  step   loss"):out.index("  tolerance (fp32)")].splitlines()
    assert [line.split()[0] for line in table[1:]] == ["1", "2"]
    assert "no known cause" not in out and "exceeds tolerance" not in out
    assert "(pipeline: the loss is the last stage's" in out
    # Every stage walked the same batches, which are those 1 process trains on.
    assert "steps: each step's samples over all ranks are exactly those 1 process trains on" in out
    assert "data verdict: PASS" in out
    # No replicas; the tied embedding/head is held by both stages and stays identical.
    assert "sync: pipeline: each of 2 ranks holds its own stage, so there are no replicas" in out
    assert "every stage holding one of them holds an identical copy" in out
    assert "explain: not available under --strategy pipeline" in out
    assert out.rstrip().splitlines()[-1].startswith("verify: PASS (equivalence passed; data passed; sync passed)")
    # Rank 0 saved the whole model (both stages) under the model's own names, as the reference did.
    ref = torch.load(report / "single" / "step-0002.pt", weights_only=True)
    dist = torch.load(report / "dist" / "step-0002.pt", weights_only=True)
    assert list(dist["params"]) == list(ref["params"]) and set(dist["grads"]) == set(ref["grads"])
    # The stages' state, saved whole by rank 0 at every step boundary, loaded back into one process.
    lock = torch.load(report / "lockstep" / "step-0002.pt", weights_only=True)
    assert list(lock["params"]) == list(ref["params"])
    saved = torch.load(report / "states" / "step-0002" / "state.pt", weights_only=True)
    assert set(saved["model"]) >= set(ref["params"]) and saved["optimizer"]["state"]


def test_verify_takes_pipeline_x_data_parallel(tmp_path: Path) -> None:
    # --mesh pp=2,dp=2: two replicas of a 2-stage pipeline; every copy of a stage must stay equal.
    res = run([sys.executable, "-m", "scaleloop.verify", "--mesh", "pp=2,dp=2", "--microbatches", "2", "--model",
               "tinygpt", "--data", "tokens", "--n-samples", "64", "--seq-len", "8", "--vocab-size", "32",
               "--batch-size", "8", "--accumulate", "2", "--optimizer", "sgd", "--lr", "0.5", "--steps", "2",
               "--device", "cpu", "--check", "all"], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    out = res.stdout
    assert "one stage of the model each in 2 replicas, accumulate 2: every stage runs its replica's 2 samples" in out
    assert "steps: each step's samples over all ranks are exactly those 1 process trains on" in out
    assert "sync: pipeline x 2 replicas" in out and "every rank holding one of them holds an identical copy" in out
    assert out.rstrip().splitlines()[-1].startswith("verify: PASS (equivalence passed; data passed; sync passed)")
