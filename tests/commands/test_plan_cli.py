"""``scaleloop plan``: a ranked table, a train line that scaleloop train accepts, one-line errors."""
from __future__ import annotations

import shlex

import pytest

from scaleloop.cli import build_parser, main
from scaleloop.commands.cmdline import flag_values
from scaleloop.config import resolve


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
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1 and says in err and "Traceback" not in err + out


def test_a_resized_tinygpts_train_line_runs_once_its_factory_is_saved(
        capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The line named ``YOUR.module:tinygpt_factory``, which no train could import; now a module the
    note gives, one line, saved where train runs."""
    assert main(["plan", "--gpus", "1", "--gpu", "h100", "--d-model", "32", "--n-layers", "3", "--seq-len", "16",
                 "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.strip().startswith("scaleloop train"))
    note = next(l for l in out.splitlines() if "where you run train: " in l)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "plan_tinygpt.py").write_text(note.split("where you run train: ", 1)[1] + "\n")
    monkeypatch.delitem(__import__("sys").modules, "plan_tinygpt", raising=False)
    argv = shlex.split(line)[1:]
    argv[argv.index("--device") + 1] = "cpu"
    argv[argv.index("--precision") + 1] = "fp32"
    assert argv[argv.index("--model") + 1] == "plan_tinygpt:build"
    code = main([*argv, "--max-steps", "1", "--n-samples", "32", "--out", str(tmp_path / "run"), "--no-progress"])
    assert code == 0, capsys.readouterr().err
