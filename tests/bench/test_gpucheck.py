"""``make gpu-check``'s plan and report, on a CPU (CI): CUDA checks skipped by name, every
command line parsed, the rest run, the report written - so the plan cannot rot between GPU runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from scaleloop.bench import gpucheck

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_mode_runs_the_plan_and_writes_the_report(tmp_path: Path, capsys) -> None:
    assert gpucheck.main(["--cpu", "--out", str(tmp_path)]) == 0
    [report] = tmp_path.glob("*_gpu-check.md")
    text = report.read_text()
    outcomes = json.loads(report.with_suffix(".json").read_text())
    assert [o["name"] for o in outcomes] == [c.name for c in gpucheck.PLAN]
    by_name = {o["name"]: o["status"] for o in outcomes}
    assert by_name["scaleloop env"] == "passed"
    for check in gpucheck.PLAN:
        if check.needs_cuda:
            assert by_name[check.name] == "skipped: needs CUDA; its command line parses", check.name
    for needed in ("train single-fp32", "train dp-bf16", "train ddp-fp16", "train fsdp-bf16", "train compile",
                   "train fused-optimizer", "train channels-last", "train data-on-device", "tune-batch",
                   "bench devices", "bench overhead", "bench mfu", "CUDA tests"):
        assert needed in by_name
    for item in gpucheck.NOT_RUN:
        assert f"- {item}" in text
    assert "| check | result | seconds | command |" in text


def test_cuda_test_files_exist() -> None:
    for name in gpucheck.CUDA_TEST_FILES:
        assert (ROOT / name).is_file(), name


def test_a_command_that_does_not_parse_fails_the_check(tmp_path: Path) -> None:
    bad = gpucheck.Check("train typo", (*gpucheck.SCALELOOP, "train", "--epoch", "3"))
    [outcome] = gpucheck.run_plan(tmp_path, cuda=False, plan=[bad])
    assert outcome.status.startswith("skipped: needs CUDA; ITS COMMAND LINE DOES NOT PARSE: ")
    failing = gpucheck.Check("fails", (sys.executable, "-c", "raise SystemExit(3)"), needs_cuda=False)
    [outcome] = gpucheck.run_plan(tmp_path, cuda=False, plan=[failing])
    assert outcome.status == "failed: exit 3"
