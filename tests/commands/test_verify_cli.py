"""The verify subcommand's flags: defaults, and bad input as one line with exit code 2."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from scaleloop.commands.cmdline import Parser, add_config_flags
from scaleloop.errors import UsageError
from scaleloop.verify.__main__ import main as verify_main
from scaleloop.commands.verify import add_parser, resolve_verify, run

FAST = ["--data", "random", "--n-samples", "64", "--model", "simplenet", "--device", "cpu"]


def parse(*argv: str) -> argparse.Namespace:
    parser = Parser(prog="scaleloop")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    add_parser(sub, Parser, add_config_flags)
    return parser.parse_args(["verify", *argv])


def test_defaults_compare_two_ddp_processes() -> None:
    cfg, opts = resolve_verify(parse(*FAST))
    assert (cfg.launch.nproc, cfg.parallel.strategy, cfg.launch.max_restarts) == (2, "ddp", 0)
    assert opts.checks == ("equivalence",) and opts.steps == 5 and opts.explain_step is None


def test_flags_and_config_file_are_kept(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("nproc = 4\nbatch_size = 64\n")
    cfg, opts = resolve_verify(parse("--config", str(config), "--strategy", "allreduce", "--check", "sync,data",
                                     "--check", "equivalence", "--explain", "--steps", "3", *FAST))
    assert (cfg.launch.nproc, cfg.parallel.strategy, cfg.optim.batch_size) == (4, "allreduce", 64)
    assert opts.checks == ("equivalence", "sync", "data")
    assert opts.explain_step == 1 and opts.steps == 3
    assert resolve_verify(parse("--check", "all", "--explain", "2", *FAST))[1].explain_step == 2


@pytest.mark.parametrize("argv, needle", [
    (["--batch-size", "30", "--accumulate", "2"], "use a multiple of 4, such as 28 or 32"),
    (["--strategy", "single"], "nothing to compare"),
    (["--nproc", "1"], "compare one process with itself"),
    (["--nnodes", "2", "--master-addr", "10.0.0.1"], "one machine"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--steps", "3", "--explain", "4"], "must be in 1..3"),
    (["--check", "speed"], "--check 'speed' is not one of"),
    (["--loss", "no_colon"], "expected 'package.module:function'"),
    (["--tolerance", "0"], "--tolerance must be a positive number"),
])
def test_bad_input_is_a_usage_error(argv: list[str], needle: str) -> None:
    with pytest.raises(UsageError, match=None) as info:
        resolve_verify(parse(*FAST, *argv))
    assert needle in str(info.value)


def test_unimportable_loss_and_model_are_named_before_anything_runs() -> None:
    with pytest.raises(UsageError, match="cannot import module 'no_such_module_xyz'"):
        run(parse(*FAST, "--loss", "no_such_module_xyz:fn"))
    with pytest.raises(UsageError, match="unknown model 'resnet9000'"):
        run(parse("--model", "resnet9000"))


def test_dataparallel_needs_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UsageError, match="--strategy dp needs CUDA"):
        run(parse(*FAST, "--strategy", "dp", "--batch-size", "16"))


def test_report_dir_that_holds_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("precious")
    with pytest.raises(UsageError, match="not a verify report"):
        run(parse(*FAST, "--batch-size", "16", "--report", str(tmp_path)))
    assert (tmp_path / "thesis.tex").read_text() == "precious"


def test_main_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert verify_main([*FAST, "--batch-size", "31"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("scaleloop: error: --batch-size 31")
    assert verify_main(["--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_help_lists_verify_flags_and_train_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        verify_main(["--help-all"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--steps", "--check", "--explain", "--loss", "--tolerance", "--report", "--sync-batchnorm", "--nproc"):
        assert flag in out
    with pytest.raises(SystemExit) as info:
        verify_main(["--help"])   # the short one: what a first comparison needs
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--steps" in out and "--nproc" in out and "--no-sync-batchnorm" not in out
    # Verify's own defaults, not train's (1 process, --strategy auto), as resolve_verify applies them.
    flat = " ".join(out.split())
    assert "(default here: 2, or the --mesh's size)" in flat and "(default here: ddp, or mesh with --mesh)" in flat
    cfg, _ = resolve_verify(parse(*FAST))
    assert cfg.launch.nproc == 2 and cfg.parallel.strategy == "ddp"


def test_subparsers_of_another_class_are_refused() -> None:
    parser = argparse.ArgumentParser()
    with pytest.raises(TypeError, match="parser_class=Parser"):
        add_parser(parser.add_subparsers(), Parser, add_config_flags)
