"""``scaleloop plan``: a ranked table, a train line that scaleloop train accepts, one-line errors."""
from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from scaleloop.cli import build_parser, main
from scaleloop.commands.cmdline import flag_values
from scaleloop.config import load_toml, resolve
from scaleloop.models import TinyGPT


def test_plan_ranks_the_layouts_and_gives_a_train_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--gpus", "4", "--gpu", "h100", "--batch-size", "16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "layout" in out and "peak GB" in out
    for family in ("dp dp=4", "fsdp fsdp=4", "hsdp dp=2,fsdp=2", "fsdp x tp fsdp=2,tp=2", "pp x dp pp=2,dp=2",
                   "+ac", "+offload"):
        assert family in out, family
    line = next(l for l in out.splitlines() if l.strip().startswith("scaleloop train"))
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert resolve({}, flag_values(args)).validate().nproc == 4
    assert "why the others lost:" in out and "slower" in out


def test_layouts_the_batch_does_not_split_over_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpus", "4", "--gpu", "h100", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "dp dp=4: --batch-size 2 does not split over its 4 data-parallel ranks" in out


def test_a_model_too_large_for_the_gpus_is_said_to_fit_nowhere(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--gpus", "2", "--gpu", "0.001", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "nothing fits" in out and "does not fit" not in out.split("nothing fits")[1]


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "8", "--gpu", "v100"], "unknown --gpu 'v100'"),
    (["--gpus", "6", "--gpu", "h100", "--nodes", "4"], "does not split evenly over --nodes 4"),
    (["--gpus", "0", "--gpu", "h100"], "--gpus must be a positive integer"),
    (["--gpus", "4", "--gpu", "h100", "--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--gpus", "4", "--gpu", "h100", "--mfu", "1.5"], "--mfu must be in (0, 1]"),
    (["--gpus", "4", "--gpu", "h100", "--d-model", "130"], "must be divisible by --n-heads"),
    (["--gpus", "4", "--gpu", "h100", "--data", "tokens", "--data-dir", "d"], "--data tokens reads none"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1 and says in err and "Traceback" not in err + out


def write_token_files(directory: Path, vocab: int, tokens: int = 4096) -> None:
    """``train.bin`` and ``val.bin`` of uint16 token ids, as nanoGPT's prepare.py writes them."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    rng.integers(0, vocab, tokens, dtype=np.uint16).tofile(directory / "train.bin")
    rng.integers(0, vocab, tokens // 4, dtype=np.uint16).tofile(directory / "val.bin")


def test_a_resized_tinygpts_train_line_runs_as_printed(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The line once named ``YOUR.module:tinygpt_factory`` and ``--data tokens``, which no train could run as
    printed; now train's own flags and the user's data named as such. Only the data directory is filled in,
    and ``--device cpu --max-steps 1`` added: the run trains the planned model, and saves its sizes."""
    assert main(["plan", "--gpus", "1", "--gpu", "h100", "--d-model", "32", "--n-layers", "3", "--seq-len", "16",
                 "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.strip().startswith("scaleloop train"))
    assert "--model tinygpt --d-model 32 --n-layers 3 --n-heads 4 --vocab-size 256" in line
    assert "--data tokenfile --data-dir YOUR_DATA_DIR" in line and "--data tokens " not in line
    assert "note: YOUR_DATA_DIR: a directory with train.bin and val.bin as nanoGPT's prepare.py writes them" in out
    write_token_files(tmp_path / "data", vocab=256)
    monkeypatch.chdir(tmp_path)   # where the run directory goes: the line names none
    argv = shlex.split(line.replace("YOUR_DATA_DIR", str(tmp_path / "data")))[1:]
    assert main([*argv, "--device", "cpu", "--max-steps", "1"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [config] = tmp_path.glob("**/config.toml")
    saved = load_toml(config)
    assert (saved["model"], saved["d_model"], saved["n_layers"], saved["n_heads"]) == ("tinygpt", 32, 3, 4)
    assert saved["data_dir"] == str(tmp_path / "data") and saved["precision"] == "bf16"
    # The weights it wrote are those of the planned model, name for name and shape for shape.
    planned = TinyGPT(256, 16, d_model=32, n_layers=3, n_heads=4).state_dict()
    trained = torch.load(config.parent / "model.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in trained.items()} == {k: tuple(v.shape) for k, v in planned.items()}
