"""``scaleloop bench overhead --mode datapath|startup``: structure and sanity of the results
(never a timing claim)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scaleloop.commands import bench as bench_cli


def _read(out_dir: Path, what: str) -> tuple[dict[str, Any], str]:
    [json_path] = out_dir.glob(f"*_{what}-quick.json")
    return json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text()


def test_datapath_quick(tmp_path: Path) -> None:
    argv = ["overhead", "--mode", "datapath", "--quick", "--threads", "1", "--data", "random", "--n-samples", "512",
            "--batch-size", "128", "--out", str(tmp_path)]
    assert bench_cli.main(argv) == 0
    data, md = _read(tmp_path, "datapath")
    d = data["data"]
    assert d["data_path"] == "dataloader" and data["settings"]["mode"] == "datapath"
    assert [r["first"] for r in d["repetitions"]] == ["raw", "scaleloop", "raw"]          # interleaved
    assert d["final_weights_max_abs_diff"] <= 1e-6     # the tutorial's loop saw the same batches
    only = d["data_only"]
    assert only["identical_batches"] is True
    assert [r["path"] for r in only["rows"]][0].startswith("tutorial DataLoader")
    assert all(r["per_batch_us"] > 0 for r in only["rows"]) and only["rows"][0]["speedup"] == 1.0
    assert "One epoch of batches alone" in md and data["headline"] in md
    assert "--mode datapath" in data["command"]


@pytest.mark.parametrize("mode", ["loop", "datapath"])
def test_fused_optimizer_is_scaleloops_and_the_tutorial_loop_keeps_its_own(tmp_path: Path, mode: str) -> None:
    """--fused-optimizer: in --mode loop both loops use it (the same work, bit for bit); in
    --mode datapath the tutorial's loop stays as written, so the weights differ by rounding only."""
    # One timed repetition, not --quick's 3: the weights compared are the warm-up runs' (every mode
    # trains each loop once before its timed repetitions), and nothing here reads a timing.
    argv = ["overhead", "--mode", mode, "--quick", "--threads", "1", "--data", "random", "--n-samples", "512",
            "--batch-size", "128", "--fused-optimizer", "--repeats", "1", "--out", str(tmp_path)]
    assert bench_cli.main(argv) == 0
    data, md = _read(tmp_path, "datapath" if mode == "datapath" else "overhead")
    assert data["settings"]["fused_optimizer"] is True and "--fused-optimizer" in data["command"]
    diff = data["data"]["final_weights_max_abs_diff"]
    if mode == "loop":
        assert diff == 0.0 and "and so did the raw loop" in md
    else:
        assert 0.0 < diff < 1e-4 and "PyTorch's default one" in md


@pytest.mark.slow
def test_startup_quick(tmp_path: Path) -> None:
    assert bench_cli.main(["overhead", "--mode", "startup", "--quick", "--repeats", "1", "--out", str(tmp_path)]) == 0
    data, md = _read(tmp_path, "startup")
    d = data["data"]
    assert set(d["seconds"]) == {"import torch", "import torch, scaleloop", "import scaleloop",
                                 "import scaleloop; scaleloop.train", "scaleloop --help", "scaleloop train --help"}
    assert d["modules"]["import scaleloop"] == [] and d["modules"]["scaleloop --help"] == []
    assert "torch" in d["modules"]["import scaleloop; scaleloop.train"]
    assert any(r["module"].startswith("scaleloop") for r in d["slowest_imports"])
    assert not list(tmp_path.glob("*.png"))          # a table, no chart
    assert "| import torch |" in md


USERMODELS = Path(__file__).resolve().parent.parent / "distributed" / "scripts"


@pytest.mark.parametrize("mode", ["loop", "datapath"])
def test_keyword_batches_and_a_models_own_loss(tmp_path: Path, monkeypatch, mode: str) -> None:
    """A model taking a mapping batch (input_ids, attention_mask, labels) and returning its own
    loss: both loops read it by the same input and output rules and end with the same weights."""
    monkeypatch.syspath_prepend(str(USERMODELS))
    # One timed repetition (as above: the weights compared are the warm-up runs').
    argv = ["overhead", "--mode", mode, "--quick", "--threads", "1", "--model", "usermodels:Keywords",
            "--data", "usermodels:keyword_data", "--batch-size", "32", "--repeats", "1", "--out", str(tmp_path)]
    assert bench_cli.main(argv) == 0
    data, _ = _read(tmp_path, "datapath" if mode == "datapath" else "overhead")
    assert data["data"]["final_weights_max_abs_diff"] <= 1e-6
    if mode == "datapath":
        assert data["data"]["data_only"]["identical_batches"] is True


def test_raw_gather_loop_needs_tensors_in_memory(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(USERMODELS))
    argv = ["overhead", "--quick", "--threads", "1", "--model", "usermodels:Keywords",
            "--data", "usermodels:keyword_items", "--out", str(tmp_path)]
    assert bench_cli.main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Traceback" in line]
    assert len(errors) == 1 and errors[0].startswith("scaleloop: error: ") and "--mode datapath" in errors[0], errors


def test_the_raw_loop_gets_channels_last_as_scaleloop_does() -> None:
    # A fair baseline: with --channels-last the hand-written loop trains channels-last weights on
    # channels-last inputs (--compile likewise compiles its model), and still does the same work.
    import torch

    from scaleloop.bench.rawloop import raw_train
    from scaleloop.config import TrainConfig

    # SGD: Adam would turn the rounding noise of a bias before BatchNorm (gradient ~0) into full steps.
    cfg = TrainConfig(model="convnet", data="images", image_size=8, n_samples=64, batch_size=32, epochs=1,
                      test_fraction=0.0, device="cpu", optimizer="sgd", lr=0.05)
    plain = raw_train(cfg, torch.device("cpu"))
    fast = raw_train(cfg.replace(channels_last=True), torch.device("cpu"))
    convs = [name for name, t in fast.state.items() if t.dim() == 4]
    assert convs and all(fast.state[n].is_contiguous(memory_format=torch.channels_last) for n in convs)
    assert not plain.state[convs[0]].is_contiguous(memory_format=torch.channels_last)
    for name, tensor in plain.state.items():
        assert torch.allclose(tensor.float(), fast.state[name].float(), atol=1e-5), name
