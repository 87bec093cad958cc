"""``scaleloop bench``: flags, one-line usage errors, and the in-process --quick benches' outputs.

The multi-process benches (scaling, strategies) are tested in tests/distributed/test_bench.py.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from scaleloop.commands import bench as bench_cli
from scaleloop.commands.cmdline import Parser

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def parse(*argv: str) -> argparse.Namespace:
    """Parse as ``scaleloop bench ...`` will, once cli.py registers the subcommand."""
    parser = Parser(prog="scaleloop")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    bench_cli.add_parser(sub, Parser)
    return parser.parse_args(["bench", *argv])


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = bench_cli.main(list(argv))
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scaleloop: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_every_command_is_registered() -> None:
    for command in bench_cli.COMMANDS:
        assert parse(command).bench_command == command


@pytest.mark.parametrize("argv,needle", [
    ((), "required"),                                          # bench needs a command
    (("scaling", "--workers", "2,4"), "must include 1"),
    (("scaling", "--workers", "1"), "at least two"),
    (("scaling", "--workers", "one,two"), "separated by commas"),
    (("scaling", "--strategy", "single"), "cannot be scaled"),
    (("scaling", "--strong", "--batch-size", "63", "--workers", "1,2"), "does not divide by 2"),
    (("scaling", "--compute-ms", "-1"), "--compute-ms"),
    (("scaling", "--target-efficiency", "1.5"), "--target-efficiency"),
    (("scaling", "--target-mfu", "40"), "--target-mfu must be in (0, 1]"),
    (("scaling", "--repeats", "0"), "--repeats must be a positive"),
    (("strategies", "--workers", "3", "--batch-size", "32"), "does not split"),
    (("overhead", "--model", "nosuchnet"), "unknown model"),
    (("mfu", "--batch-size", "0"), "--batch-size must be a positive"),
    (("devices", "--epoch", "3"), "unrecognized"),               # no abbreviations
    (("overhead", "--device", "cuda"), "CUDA is not available"),
    (("devices", "--tag", "a b"), "--tag"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: tuple, needle: str,
                                          tmp_path: Path) -> None:
    if "cuda" in argv:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    argv = (*argv, "--out", str(tmp_path)) if argv else argv
    line = usage_error(capsys, *argv)
    assert needle in line, line
    assert not list(tmp_path.glob("*.json")), "nothing is written for bad input"


def test_presets_and_flags() -> None:
    args = parse("scaling", "--quick")
    assert bench_cli._value(args, "steps") == bench_cli.PRESETS["scaling"]["quick"]["steps"]
    args = parse("scaling", "--quick", "--steps", "99")
    assert bench_cli._value(args, "steps") == 99                # a flag beats the preset
    assert bench_cli.parse_workers("4,1,2,2", "cpu") == (1, 2, 4)
    assert bench_cli.parse_workers(None, "cpu")[0] == 1
    line = bench_cli.command_line(parse("scaling", "--quick", "--workers", "1,2", "--strong"))
    assert line == "scaleloop bench scaling --quick --workers 1,2 --strong"
    line = bench_cli.command_line(parse("scaling", "--target-efficiency", "0.8", "--repeats", "5"))
    assert line == "scaleloop bench scaling --repeats 5 --target-efficiency 0.8"


def test_scaling_default_is_compute_bound_and_repeated() -> None:
    """The efficiency check's default: a per-worker batch large enough that compute dominates the
    all-reduce, in interleaved repetitions; --quick stays one CI-sized pass."""
    args = parse("scaling")
    assert bench_cli._value(args, "model") == "convnet" and bench_cli._value(args, "batch_size") >= 256
    assert bench_cli._value(args, "repeats") >= 3
    assert args.target_efficiency == 0.9 and args.threads is None      # threads: 1 per worker (run() sets it)
    assert bench_cli._value(parse("scaling", "--quick"), "repeats") == 1


def _read(out_dir: Path, what: str) -> tuple[dict[str, Any], str]:
    [json_path] = out_dir.glob(f"*_{what}-quick.json")
    assert json_path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    return json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text()


def test_devices_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_cli.main(["devices", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "devices: cpu" in err                                 # progress on stderr
    data, md = _read(tmp_path, "devices")
    rows = {r["device"]: r for r in data["data"]["devices"]}
    assert set(rows) == {"cpu", "cuda", "mps"}
    assert rows["cpu"]["available"] and rows["cpu"]["samples_per_s"] > 0 and rows["cpu"]["speedup"] == 1.0
    for row in rows.values():
        if row["available"]:
            assert row["train_s_min"] <= row["train_s"] <= row["train_s_max"]
        else:
            assert "not available" in row["name"]
    assert "| device | name |" in md and "| cpu |" in out


def test_overhead_quick(tmp_path: Path) -> None:
    assert bench_cli.main(["overhead", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    data, md = _read(tmp_path, "overhead")
    d = data["data"]
    reps = d["repetitions"]
    assert len(reps) == data["settings"]["repeats"] == 3
    assert [r["first"] for r in reps] == ["raw", "scaleloop", "raw"]          # interleaved
    assert all(r["raw_s"] > 0 and r["scaleloop_s"] > 0 for r in reps)
    assert all(r["raw_samples"] == r["scaleloop_samples"] for r in reps)      # the same samples
    assert d["final_weights_max_abs_diff"] <= 1e-6                            # the same work
    assert d["ratio"] == pytest.approx(d["scaleloop_s"]["median"] / d["raw_s"]["median"])
    assert 0.2 < d["ratio"] < 20                                              # sane, not a timing claim
    assert "time / raw" in md and data["headline"] in md
    # The loop's own cost counts the gradient norm each log row shows (the raw loop takes none).
    pieces = d["loop_cost"]["pieces_us"]
    [norm] = [v for k, v in pieces.items() if k.startswith("gradient norm (every ")]
    assert norm > 0 and d["loop_cost"]["total_us"] == pytest.approx(sum(v for k, v in pieces.items() if k[0] != " "))
    assert "| gradient norm (every" in md


def test_mfu_quick(tmp_path: Path) -> None:
    assert bench_cli.main(["mfu", "--quick", "--threads", "1", "--out", str(tmp_path)]) == 0
    data, md = _read(tmp_path, "mfu")
    rows = data["data"]["rows"]
    assert [r["model"] for r in rows] == ["simplenet", "biggernet", "convnet", "tinygpt"]
    for r in rows:
        assert r["flops_per_sample"] > 0 and r["samples_per_s"] > 0
        assert r["mfu"] > 0   # (not < 1: on a busy machine the measured peak can come out below a model's rate)
        assert r["mfu"] == pytest.approx(r["flops_per_sample"] * r["samples_per_s"] / r["peak_flops_per_s"])
    # For the MLPs the counted FLOPs are at most the 6N estimate (the first layer needs no input grad).
    assert rows[0]["flops_per_sample"] <= rows[0]["six_n"]
    # The CPU's peak is measured; a known GPU's is its datasheet's (device auto picks the GPU).
    assert ("datasheet" if torch.cuda.is_available() else "measured") in data["data"]["peak"]["source"]
    assert "| model | data |" in md
    assert any(r["mfu"] > 1 for r in rows) == ("MFU over 100%" in md)


def test_multiprocess_bench_fits_workers_to_gpus() -> None:
    # gpu-first-run note 1: NCCL refuses two processes on one GPU, so `auto` falls back to the CPU
    # and says so, and an explicit cuda is refused in one line before any worker starts.
    from scaleloop.commands.bench import fit_workers_to_gpus
    from scaleloop.errors import UsageError

    said: list[str] = []
    assert fit_workers_to_gpus("auto", "cuda", 2, 1, said.append) == "cpu"
    assert len(said) == 1 and "NCCL needs one GPU per worker" in said[0]
    assert fit_workers_to_gpus("auto", "cuda", 2, 2, said.append) == "cuda" and len(said) == 1
    assert fit_workers_to_gpus("cpu", "cpu", 8, 0, said.append) == "cpu"
    with pytest.raises(UsageError, match="at most 1"):
        fit_workers_to_gpus("cuda", "cuda", 4, 1, said.append)
