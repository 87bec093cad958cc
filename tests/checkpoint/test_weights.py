"""Weights out and in (issue 55 point 3): ``model.safetensors`` with TinyGPT's tied weights; a
``--model config.json`` run saved as transformers saves it (``hf/``), which transformers loads to
the run's weights and ``scaleloop sample`` generates from; ``--init-from`` a safetensors file, a
transformers directory or a run directory, into the model before any strategy; keys that do not
fit are named in one line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
import torch

import scaleloop
from scaleloop.checkpoint.weights import load_weights, read_weights, safetensors_bytes
from scaleloop.cli import main
from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.loop.build import build_run
from scaleloop.models import TinyGPT
from scaleloop.runtime.dist import DistEnv

pytest.importorskip("safetensors")

#: A GPT-2 of one narrow layer over 32 tokens; its output layer is its token embedding (tied).
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 32, "n_positions": 16,
        "n_embd": 16, "n_layer": 1, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
QUIET = ["--device", "cpu", "--no-progress", "--tracker", "none"]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matrices: a second thread only waits (and more on a busy machine)
    yield
    torch.set_num_threads(threads)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tied_weights_go_into_safetensors_and_come_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    trained, fresh = TinyGPT(vocab_size=11, seq_len=8, d_model=16, n_heads=2), TinyGPT(11, 8, d_model=16, n_heads=2)
    file = tmp_path / "w.safetensors"
    file.write_bytes(safetensors_bytes(trained.state_dict()))   # safetensors' own save refuses the shared tensor
    assert "lm_head.weight" in read_weights(file)
    load_weights(fresh, read_weights(file), str(file))
    assert same(fresh.state_dict(), trained.state_dict())
    assert fresh.lm_head.weight is fresh.tok_emb.weight   # still tied: loading copies into the shared tensor


def test_init_from_loads_into_the_model_before_the_strategy(tmp_path: Path) -> None:
    torch.manual_seed(1)
    start = TinyGPT(vocab_size=256, seq_len=8)
    (tmp_path / "start.safetensors").write_bytes(safetensors_bytes(start.state_dict()))
    cfg = TrainConfig(model="tinygpt", data="tokens", seq_len=8, n_samples=16, batch_size=8, device="cpu",
                      init_from=str(tmp_path / "start.safetensors"), progress=False).validate()
    run = build_run(cfg, DistEnv())
    assert same(run.strategy.unwrap(run.model).state_dict(), start.state_dict())


def test_init_from_a_model_of_other_keys_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "gpt.safetensors").write_bytes(safetensors_bytes(TinyGPT(vocab_size=5, seq_len=4).state_dict()))
    assert main(["train", "--data", "random", "--n-samples", "16", "--init-from", str(tmp_path / "gpt.safetensors"),
                 "--out", str(tmp_path / "run"), *QUIET]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "does not fit this model: missing from the checkpoint: net.0.weight" in err
    assert "not in the model: blocks" in err
    with pytest.raises(UsageError, match="does not exist"):
        read_weights(tmp_path / "nothing")


def test_a_transformers_run_saves_hf_which_loads_to_its_weights_and_samples(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    run = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "config.json"), "--data", "tokens", "--vocab-size", "32",
                 "--seq-len", "8", "--n-samples", "32", "--batch-size", "16", "--max-steps", "2", "--out", str(run),
                 *QUIET]) == 0
    weights = torch.load(run / "model.pt", weights_only=True)
    assert same(read_weights(run / "model.safetensors"), weights)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run / "hf", local_files_only=True)
    assert same(loaded.state_dict(), weights)
    # save_pretrained left the tied output layer out of hf/: --init-from fills it from the embedding.
    assert "lm_head.weight" not in read_weights(run / "hf")
    from scaleloop.hfconfig import build_causal_lm

    fresh = build_causal_lm(str(tmp_path / "config.json"))
    load_weights(fresh, read_weights(run / "hf"), "hf")
    assert same(fresh.state_dict(), weights)
    # No meta.pkl (generated tokens): the prompt and the samples are token ids, through generate.
    texts = scaleloop.sample(run, "1 2 3", max_new_tokens=4, seed=0, num_samples=2)
    assert len(texts) == 2 and all(t.split()[:3] == ["1", "2", "3"] and len(t.split()) <= 7 for t in texts)
    assert all(0 <= int(i) < 32 for t in texts for i in t.split())
    assert texts == scaleloop.sample(run, "1 2 3", max_new_tokens=4, seed=0, num_samples=2)
