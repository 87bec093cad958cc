"""``make gpu-check``'s checks and report, on a CPU (CI): CUDA checks skipped by name, every
command line parsed, the rest run, the report written - so the checks cannot rot between GPU runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import gpucheck  # tools/ (tests/tools/conftest.py puts it on the path)

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_mode_runs_the_plan_and_writes_the_report(tmp_path: Path, capsys) -> None:
    assert gpucheck.main(["--cpu", "--out", str(tmp_path)]) == 0
    [report] = tmp_path.glob("*_gpu-check.md")
    text = report.read_text()
    outcomes = json.loads(report.with_suffix(".json").read_text())
    assert [o["name"] for o in outcomes] == [c.name for c in gpucheck.CHECKS]
    by_name = {o["name"]: o["status"] for o in outcomes}
    assert by_name["scaleloop env"] == "passed"
    for check in gpucheck.CHECKS:
        if check.needs_cuda:
            assert by_name[check.name] == "skipped: needs CUDA; its command line parses", check.name
    for needed in ("train single-fp32", "train dp-bf16", "train ddp-fp16", "train fsdp-bf16", "train compile",
                   "train fused-optimizer", "train channels-last", "train data-on-device", "tune-batch",
                   "bench devices", "bench overhead", "bench mfu", "CUDA tests", "bench mfu gpt2-small",
                   "bench overhead convnet channels-last compile"):
        assert needed in by_name
    assert "## Figures (from each bench command's JSON)" in text
    assert "### bench mfu gpt2-small" in text and "- no figures: skipped: needs CUDA" in text
    assert "estimated 20 min on one H100, budget 20 min" in text
    for item in gpucheck.NOT_RUN:
        assert f"- {item}" in text
    assert "| check | result | seconds | command |" in text


def test_cuda_test_files_exist() -> None:
    for name in gpucheck.CUDA_TEST_FILES:
        assert (ROOT / name).is_file(), name
    assert (gpucheck.PLAN_VALIDATE / "__main__.py").is_file()


def test_a_command_that_does_not_parse_fails_the_check(tmp_path: Path) -> None:
    bad = gpucheck.Check("train typo", (*gpucheck.SCALELOOP, "train", "--epoch", "3"))
    [outcome] = gpucheck.run_checks(tmp_path, cuda=False, checks=[bad])
    assert outcome.status.startswith("skipped: needs CUDA; ITS COMMAND LINE DOES NOT PARSE: ")
    failing = gpucheck.Check("fails", (sys.executable, "-c", "raise SystemExit(3)"), needs_cuda=False)
    [outcome] = gpucheck.run_checks(tmp_path, cuda=False, checks=[failing])
    assert outcome.status == "failed: exit 3"


def test_the_plan_fits_its_budget_and_every_bench_writes_json_it_can_find() -> None:
    assert sum(c.estimate_s for c in gpucheck.CHECKS) <= gpucheck.BUDGET_S
    tags = [c.figures for c in gpucheck.CHECKS if c.figures is not None]
    assert len(tags) == len(set(tags)) == sum(" bench " in f" {c.name} " for c in gpucheck.CHECKS)
    cl = next(c for c in gpucheck.CHECKS if c.name == "bench overhead convnet channels-last compile")
    assert "--channels-last" in cl.argv and "--compile" in cl.argv
    gpt2 = next(c for c in gpucheck.CHECKS if c.name == "bench mfu gpt2-small")
    assert {"--compile", "bf16", "1024"} <= set(gpt2.argv) and "40%" in (gpt2.target or "")


def test_checks_past_the_budget_are_not_run(tmp_path: Path) -> None:
    quick = gpucheck.Check("quick", (sys.executable, "-c", "pass"), needs_cuda=False)
    [first, second] = gpucheck.run_checks(tmp_path, cuda=False, checks=[quick, quick], budget_s=5)
    assert first.status == second.status == "not run: the checks' 0-minute budget was spent"


def _mfu_json(bench: Path, mfu: float, gpu: str) -> None:
    bench.mkdir(parents=True, exist_ok=True)
    rows = [{"model": "gpt2", "samples_per_s": 12.5, "mfu": mfu, "breakdown": {"data_s": 0.1}}]
    (bench / "2026-01-01_x_mfu-gpt2-small.json").write_text(json.dumps({
        "headline": f"highest MFU: gpt2 at {100 * mfu:.1f}%", "hardware": {"gpus": [{"name": gpu}]},
        "tables": [{"title": "Model FLOPs utilisation", "columns": ["model", "samples_per_s", "mfu"], "rows": rows}],
        "data": {"rows": rows}}))


def test_figures_come_from_the_json_with_the_target_next_to_them(tmp_path: Path) -> None:
    gpt2 = next(c for c in gpucheck.CHECKS if c.name == "bench mfu gpt2-small")
    passed = [gpucheck.Outcome(gpt2.name, "passed")]
    for mfu, gpu, verdict in ((0.45, "NVIDIA H100 80GB HBM3", "measured 45.0%: met"),
                              (0.31, "NVIDIA H100 80GB HBM3", "measured 31.0%: NOT met"),
                              (0.52, "NVIDIA H200", "measured 52.0%: not an H100: not judged")):
        _mfu_json(tmp_path / gpu / "bench", mfu, gpu)
        text = "\n".join(gpucheck.figures_of([gpt2], passed, tmp_path / gpu / "bench"))
        assert f"- target: MFU >= 40% on an H100; {verdict}" in text
        assert f"| gpt2 | 12.5 | {mfu:.4g} |" in text
    failed = [gpucheck.Outcome(gpt2.name, "failed: exit 1")]
    assert "- no figures: failed: exit 1" in gpucheck.figures_of([gpt2], failed, tmp_path / "H200" / "bench")


def test_the_gpt2_small_preset_has_gpt2_small_size() -> None:
    import torch

    from scaleloop.bench.mfu import gpt2_small
    from scaleloop.data.info import DataInfo

    info = DataInfo(name="tokens", input_shape=(1024,), num_classes=50257, task="lm")
    with torch.device("meta"):   # the shape only: no 0.5 GB of weights
        model = gpt2_small(info)
    params = sum(p.numel() for p in model.parameters())
    assert 123e6 < params < 125e6, params
