"""Weights out and in on two processes (issue 55, point 3): a transformers model trained under the
sharded strategies (FSDP's shards, the pipeline's stages) is saved whole, as ``model.pt``,
``model.safetensors`` and ``hf/``, which transformers' ``from_pretrained`` loads to the run's
weights; and ``--init-from`` that ``hf/`` on two processes starts from those weights, as one
process does (one step later both agree within fp32 rounding).

One process's side of the same (and the tied output layer): tests/checkpoint/test_weights.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

from procs import child_env, run  # noqa: E402
from scaleloop.checkpoint.weights import read_weights  # noqa: E402

#: A GPT-2 of two narrow layers over 32 tokens (its output layer tied to the token embedding), without
#: dropout: one process and two draw different masks.
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 32, "n_positions": 16,
        "n_embd": 16, "n_layer": 2, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
COMMON = ["--data", "tokens", "--vocab-size", "32", "--seq-len", "8", "--n-samples", "64", "--batch-size", "16",
          "--device", "cpu", "--no-progress", "--tracker", "none", "--seed", "3"]
TIMEOUT_S = 300
STRATEGIES = {"fsdp": ["--strategy", "fsdp"], "pipeline": ["--strategy", "pipeline", "--microbatches", "2"]}


def train(args: list[str], cwd: Path) -> None:
    """``scaleloop train ARGS``: a fork of the tests' fork server, as are the torchrun agent and workers
    it starts (``procs.run``; a fresh start of each strategy: test_users_launch.py)."""
    res = run([sys.executable, "-m", "scaleloop", "train", *args], cwd=cwd, timeout=TIMEOUT_S, merge=True,
              env=child_env({"OMP_NUM_THREADS": "1"}))
    assert res.returncode == 0, res.stdout


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt2") / "config.json"
    path.write_text(json.dumps(GPT2))
    return path


@pytest.fixture(scope="module")
def runs(config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-step run on two processes under each sharded strategy."""
    root = tmp_path_factory.mktemp("runs")
    for name, flags in STRATEGIES.items():
        train(["--model", str(config), *COMMON, "--max-steps", "2", "--nproc", "2", *flags, "--out", str(root / name)], root)
    return {name: root / name for name in STRATEGIES}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_sharded_run_saves_whole_weights_that_transformers_loads(runs: dict[str, Path], strategy: str) -> None:
    run = runs[strategy]
    weights = torch.load(run / "model.pt", weights_only=True)
    assert "transformer.h.1.mlp.c_fc.weight" in weights   # every layer, not one stage's or one shard's
    assert same(read_weights(run / "model.safetensors"), weights)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", local_files_only=True)
    assert same(loaded.state_dict(), weights)


def test_init_from_on_two_processes_starts_where_one_process_does(runs: dict[str, Path], config: Path,
                                                                   tmp_path: Path) -> None:
    start = runs["fsdp"] / "hf"
    # SGD: Adam's first step is lr x the gradient's sign, which rounding flips where a gradient is ~0.
    for name, nproc in (("one", ["--strategy", "single"]), ("two", ["--nproc", "2", "--strategy", "fsdp"])):
        train(["--model", str(config), *COMMON, "--optimizer", "sgd", "--init-from", str(start), "--max-steps", "1", *nproc,
               "--out", str(tmp_path / name)], tmp_path)
    one = torch.load(tmp_path / "one" / "model.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    began = torch.load(runs["fsdp"] / "model.pt", weights_only=True)
    largest = max(float(t.abs().max()) for t in one.values())
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert worst <= 1e-6 * largest, (worst, largest)
    # One step from the saved weights: near them, not at a fresh model's random start.
    moved = max(float((one[k] - began[k]).abs().max()) for k in one)
    assert 0 < moved < 0.05 * largest, (moved, largest)
