"""``make gpu-check``: every CUDA path of the project in one short run, and one dated report.

A GPU machine is lent for half an hour, with its own torch and no package index. This module
holds the checks (:data:`CHECKS`: what to run, what it needs) and runs them: each check is a command
(``scaleloop ...`` or pytest) in its own process with a time limit, and the report under
``benchmarks/`` says for each what passed, what failed (with the last lines it printed), what
was skipped because this machine lacks what it needs, and what one GPU cannot show at all.

``python tools/gpucheck.py --cpu`` runs the same checks where there is no GPU (CI): it
checks that every command parses, runs those that need no CUDA, skips the rest by name, and
writes the same report, so that the checks and the report cannot rot between GPU runs.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from scaleloop.bench.mfu import GPT2_SMALL_FLAGS, MFU_TARGET

SCALELOOP = (sys.executable, "-m", "scaleloop")
#: scaleloop plan's check against measurement (tools/plan_validate, run as a directory).
PLAN_VALIDATE = Path(__file__).resolve().parent / "plan_validate"
TRAIN = (*SCALELOOP, "train", "--device", "cuda", "--epochs", "1", "--max-steps", "30", "--no-progress",
         "--no-checkpoints", "--tracker", "none")
#: The checks' whole budget: half an hour of GPU time, less start-up and installing.
BUDGET_S = 20 * 60
#: Test files that hold the CUDA tests (they skip without a GPU, so on a GPU they run).
CUDA_TEST_FILES = ("tests/runtime/test_devices.py", "tests/data/test_loader.py", "tests/loop/test_build.py",
                   "tests/loop/test_gpu_paths.py", "tests/loop/test_rows.py",
                   "tests/plan/test_tune.py", "tests/distributed/test_precision_dist.py",
                   "tests/commands/test_bench_cli.py", "tests/commands/test_verify_cli.py")


@dataclass(frozen=True)
class Check:
    """One check: a command, whether it needs CUDA, and its time limit."""

    name: str
    argv: tuple[str, ...]
    needs_cuda: bool = True
    timeout_s: int = 300
    estimate_s: int = 20           # expected seconds on one H100 (the checks' sum stays under BUDGET_S)
    figures: Optional[str] = None  # the bench JSON it writes (a glob under {out}/bench): its figures go in the report
    target: Optional[str] = None   # what the figures are measured against, printed next to them


def _bench(name: str, what: str, tag: str, *flags: str, estimate_s: int, target: Optional[str] = None) -> Check:
    argv = (*SCALELOOP, "bench", what, *flags, "--tag", tag, "--out", "{out}/bench")
    return Check(name, argv, timeout_s=max(60, 3 * estimate_s), estimate_s=estimate_s,
                 figures=f"*_{what}-{tag}.json", target=target)


def _train(name: str, *flags: str, estimate_s: int = 15) -> Check:
    argv = (*TRAIN, *flags, "--out", f"{{out}}/runs/{name}")
    return Check(f"train {name}", argv, timeout_s=max(120, 3 * estimate_s), estimate_s=estimate_s)


# Estimates: a train check is ~8 s of start-up (import, CUDA context, NCCL) and 30 short steps;
# compile adds about a minute; the CUDA tests include two 2-process CPU runs.
CHECKS: tuple[Check, ...] = (
    Check("scaleloop env", (*SCALELOOP, "env"), needs_cuda=False, timeout_s=60, estimate_s=5),
    Check("CUDA tests", (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TEST_FILES),
          timeout_s=480, estimate_s=240),
    *(_train(f"{strategy}-{precision}", "--strategy", strategy, "--precision", precision,
             *(("--nproc", "1") if strategy in ("ddp", "fsdp") else ()))
      for strategy in ("single", "dp", "ddp", "fsdp") for precision in ("fp32", "bf16", "fp16")),
    _train("compile", "--compile", estimate_s=90),
    _train("fused-optimizer", "--fused-optimizer"),
    _train("channels-last", "--model", "convnet", "--data", "images", "--channels-last"),
    _train("data-on-device", "--data-on-device"),
    # --profile on CUDA: CUDA activity in the trace, NCCL's kernels as communication (docs/profiling.md).
    _train("profile", "--strategy", "ddp", "--nproc", "1", "--profile", "3"),
    Check("tune-batch", (*SCALELOOP, "tune-batch", "--device", "cuda", "--model", "convnet", "--data", "images"),
          timeout_s=240, estimate_s=60),
    # scaleloop plan's memory model against the GPU's own answer (docs/planning.md): the largest
    # per-device batch of TinyGPT (1024 tokens, vocabulary 32,000, bf16, Adam) that fits.
    Check("tune-batch and plan agree within 10% on the largest batch that fits",
          (sys.executable, str(PLAN_VALIDATE), "--against-tune-batch"), timeout_s=240, estimate_s=30),
    _bench("bench devices", "devices", "gpucheck", estimate_s=90),
    _bench("bench overhead", "overhead", "simplenet", "--device", "cuda", estimate_s=60,
           target="scaleloop's loop at most 1.02x the hand-written CUDA loop"),
    _bench("bench overhead convnet", "overhead", "convnet", "--device", "cuda", "--model", "convnet", "--data",
           "images", estimate_s=60, target="scaleloop's loop at most 1.02x the hand-written CUDA loop"),
    _bench("bench overhead convnet channels-last compile", "overhead", "convnet-cl-compile", "--device", "cuda",
           "--model", "convnet", "--data", "images", "--channels-last", "--compile", "--repeats", "11",
           estimate_s=120, target="compared with the raw loop given the same options"),
    _bench("bench mfu", "mfu", "models", "--device", "cuda", estimate_s=60),
    _bench("bench mfu gpt2-small", "mfu", "gpt2-small", "--device", "cuda", *GPT2_SMALL_FLAGS, estimate_s=120,
           target=f"MFU >= {MFU_TARGET:.0%} on an H100"),
)

#: What one GPU cannot show, listed in every report as not run (never implied).
NOT_RUN = ("DataParallel over 2 or more GPUs", "DDP and FSDP over 2 or more GPUs (NCCL between processes)",
           "NCCL across nodes", "the pipeline strategy (it needs 2 or more ranks)")


@dataclass
class Outcome:
    """What one check did: passed, failed, skipped (and why), with its time and last output."""

    name: str
    status: str
    seconds: float = 0.0
    command: str = ""
    tail: list[str] = field(default_factory=list)


def run_checks(out: Path, cuda: bool, checks: Sequence[Check] = CHECKS, budget_s: float = BUDGET_S) -> list[Outcome]:
    """Run ``checks`` (the CUDA ones only when ``cuda``; else their command lines are parsed).

    Each check runs under its own limit, cut to what is left of ``budget_s``; once the budget
    is spent, the checks left are reported as not run, never as passed.
    """
    outcomes = []
    began = time.monotonic()
    for check in checks:
        argv = [a.replace("{out}", str(out)) for a in check.argv]
        command = " ".join(shlex.quote(a) for a in argv)
        if check.needs_cuda and not cuda:
            problem = parse_problem(argv)
            status = "skipped: needs CUDA; " + ("its command line parses" if problem is None
                                                else f"ITS COMMAND LINE DOES NOT PARSE: {problem}")
            outcomes.append(Outcome(check.name, status, command=command))
            continue
        left = budget_s - (time.monotonic() - began)
        if left < 10:
            outcomes.append(Outcome(check.name, f"not run: the checks' {budget_s / 60:.0f}-minute budget was spent",
                                    command=command))
            continue
        started = time.monotonic()
        code, tail = _run(argv, int(min(check.timeout_s, left)))
        status = "passed" if code == 0 else ("failed: over its time limit" if code is None else f"failed: exit {code}")
        outcomes.append(Outcome(check.name, status, time.monotonic() - started, command,
                                tail if code != 0 else []))
    return outcomes


def parse_problem(argv: Sequence[str]) -> Optional[str]:
    """None if a ``scaleloop`` command's flags parse (without running it), else what is wrong."""
    if tuple(argv[:3]) != SCALELOOP:
        return None   # pytest: its files are checked to exist by the test of these checks
    from scaleloop.cli import build_parser
    from scaleloop.errors import UsageError

    try:
        build_parser().parse_args(list(argv[3:]))
    except UsageError as exc:
        return str(exc)
    except SystemExit as exc:   # argparse's own exit (e.g. a bad choice in a bench subcommand)
        return f"argparse exit {exc.code}"
    return None


def _run(argv: list[str], timeout_s: int) -> tuple[Optional[int], list[str]]:
    """Exit code (None past the limit) and the last lines of output."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or "") if isinstance(exc.stdout, str) else ""
        return None, text.splitlines()[-12:]
    return res.returncode, (res.stdout + res.stderr).splitlines()[-12:]


def format_report(outcomes: Sequence[Outcome], device: str, cuda: bool, date: str,
                  figures: Sequence[str] = ()) -> str:
    """The markdown report: a table of checks, what one GPU cannot show, and failures' output."""
    passed = sum(o.status == "passed" for o in outcomes)
    failed = [o for o in outcomes if o.status.startswith("failed")]
    estimate = sum(c.estimate_s for c in CHECKS)
    lines = [f"# GPU check, {date}", "", f"- device: {device}",
             f"- {len(CHECKS)} checks, estimated {estimate / 60:.0f} min on one H100, "
             f"budget {BUDGET_S / 60:.0f} min; took {sum(o.seconds for o in outcomes) / 60:.1f} min",
             f"- mode: {'on CUDA' if cuda else 'CPU only (--cpu): CUDA checks skipped, their command lines checked'}",
             f"- {passed} passed, {len(failed)} failed, "
             f"{sum(o.status.startswith('skipped') for o in outcomes)} skipped, of {len(outcomes)}", "",
             "| check | result | seconds | command |", "| --- | --- | --- | --- |"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.1f} | `{o.command}` |" for o in outcomes]
    lines += ["", "## Not run: one GPU cannot show these", ""] + [f"- {item}" for item in NOT_RUN]
    if figures:
        lines += ["", "## Figures (from each bench command's JSON)", "", *figures]
    for o in failed:
        lines += ["", f"## {o.name}: {o.status}", "", "```", *o.tail, "```"]
    return "\n".join(lines) + "\n"


def figures_of(checks: Sequence[Check], outcomes: Sequence[Outcome], bench_dir: Path) -> list[str]:
    """The report's figures: for each bench check that passed, its JSON's headline and tables
    (the numbers as the command wrote them, never scraped from its output), and its target."""
    lines: list[str] = []
    status = {o.name: o.status for o in outcomes}
    for check in checks:
        if check.figures is None:
            continue
        lines += [f"### {check.name}", ""]
        found = sorted(bench_dir.glob(check.figures))
        if status.get(check.name) != "passed" or not found:
            lines += [f"- no figures: {status.get(check.name, 'not in this run')}", ""]
            continue
        data = json.loads(found[-1].read_text(encoding="utf-8"))
        lines += [f"- {data.get('headline', '')}", f"- JSON: `{found[-1].name}`"]
        if check.target is not None:
            lines.append(f"- target: {check.target}" + _target_verdict(check, data))
        for table in data.get("tables", []):
            lines += ["", f"{table['title']}:", "", table_markdown(table["columns"], table["rows"])]
        lines.append("")
    return lines


def _target_verdict(check: Check, data: dict[str, Any]) -> str:
    """For the MFU target: the measurement next to it, and whether it was met (on an H100 only)."""
    if check.figures is None or "mfu" not in check.figures or not data.get("data", {}).get("rows"):
        return ""
    measured = max(row["mfu"] for row in data["data"]["rows"])
    gpu = str(data.get("hardware", {}).get("gpus", ""))
    verdict = ("met" if measured >= MFU_TARGET else "NOT met") if "H100" in gpu else "not an H100: not judged"
    return f"; measured {measured:.1%}: {verdict}"


def table_markdown(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """A bench table's raw rows as markdown (numbers to 4 significant digits; nested values left out)."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        if isinstance(value, (dict, list)):
            return "..."
        return "" if value is None else str(value)

    head = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return "\n".join(head + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows])


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python tools/gpucheck.py [--cpu] [--out DIR]``; exit 1 if a check failed."""
    parser = argparse.ArgumentParser(prog="python tools/gpucheck.py", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU here: skip the CUDA checks, check the rest")
    parser.add_argument("--out", default="benchmarks", help="where the report goes (default: benchmarks)")
    args = parser.parse_args(argv)
    import torch

    from scaleloop.bench.hardware import describe_hardware, hardware_slug

    cuda = torch.cuda.is_available() and not args.cpu
    out = Path(args.out)
    work = out / "gpu-check-work"
    work.mkdir(parents=True, exist_ok=True)
    outcomes = run_checks(work, cuda)
    hw = describe_hardware()
    date = time.strftime("%Y-%m-%d")
    device = torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA)"
    report = out / f"{date}_{hardware_slug(hw, 'cuda' if cuda else 'cpu')}_gpu-check.md"
    report.write_text(format_report(outcomes, device, cuda, date, figures_of(CHECKS, outcomes, work / "bench")))
    (report.with_suffix(".json")).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    print(f"gpu-check: wrote {report}")
    return 1 if any(o.status.startswith("failed") or "DOES NOT PARSE" in o.status for o in outcomes) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
