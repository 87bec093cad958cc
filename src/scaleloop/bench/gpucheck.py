"""``make gpu-check``: every CUDA path of the project in one short run, and one dated report.

A GPU machine is lent for half an hour, with its own torch and no package index. This module
holds the plan (:data:`PLAN`: what to run, what it needs) and runs it: each check is a command
(``scaleloop ...`` or pytest) in its own process with a time limit, and the report under
``benchmarks/`` says for each what passed, what failed (with the last lines it printed), what
was skipped because this machine lacks what it needs, and what one GPU cannot show at all.

``python -m scaleloop.bench.gpucheck --cpu`` runs the same plan where there is no GPU (CI): it
checks that every command parses, runs those that need no CUDA, skips the rest by name, and
writes the same report, so that the plan and the report cannot rot between GPU runs.
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
from typing import Optional, Sequence

SCALELOOP = (sys.executable, "-m", "scaleloop")
TRAIN = (*SCALELOOP, "train", "--device", "cuda", "--epochs", "1", "--max-steps", "30", "--no-progress",
         "--no-checkpoints", "--tracker", "none")
#: Test files that hold the CUDA tests (they skip without a GPU, so on a GPU they run).
CUDA_TEST_FILES = ("tests/runtime/test_devices.py", "tests/data/test_loader.py", "tests/loop/test_speed_options.py",
                   "tests/loop/test_tune.py", "tests/distributed/test_precision_dist.py",
                   "tests/bench/test_bench_cli.py", "tests/verify/test_verify_cli.py")


@dataclass(frozen=True)
class Check:
    """One step of the plan: a command, whether it needs CUDA, and its time limit."""

    name: str
    argv: tuple[str, ...]
    needs_cuda: bool = True
    timeout_s: int = 300


def _train(name: str, *flags: str, timeout_s: int = 240) -> Check:
    argv = (*TRAIN, *flags, "--out", f"{{out}}/runs/{name}")
    return Check(f"train {name}", argv, timeout_s=timeout_s)


PLAN: tuple[Check, ...] = (
    Check("scaleloop env", (*SCALELOOP, "env"), needs_cuda=False, timeout_s=60),
    Check("CUDA tests", (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TEST_FILES),
          timeout_s=600),
    *(_train(f"{strategy}-{precision}", "--strategy", strategy, "--precision", precision,
             *(("--nproc", "1") if strategy in ("ddp", "fsdp") else ()))
      for strategy in ("single", "dp", "ddp", "fsdp") for precision in ("fp32", "bf16", "fp16")),
    _train("compile", "--compile", timeout_s=400),
    _train("fused-optimizer", "--fused-optimizer"),
    _train("channels-last", "--model", "convnet", "--data", "images", "--channels-last"),
    _train("data-on-device", "--data-on-device"),
    Check("tune-batch", (*SCALELOOP, "tune-batch", "--device", "cuda", "--model", "convnet", "--data", "images"),
          timeout_s=300),
    Check("bench devices", (*SCALELOOP, "bench", "devices", "--out", "{out}/bench"), timeout_s=400),
    Check("bench overhead", (*SCALELOOP, "bench", "overhead", "--device", "cuda", "--out", "{out}/bench"),
          timeout_s=400),
    Check("bench overhead convnet",
          (*SCALELOOP, "bench", "overhead", "--device", "cuda", "--model", "convnet", "--data", "images",
           "--tag", "convnet", "--out", "{out}/bench"), timeout_s=400),
    Check("bench mfu", (*SCALELOOP, "bench", "mfu", "--device", "cuda", "--out", "{out}/bench"), timeout_s=400),
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


def run_plan(out: Path, cuda: bool, plan: Sequence[Check] = PLAN) -> list[Outcome]:
    """Run ``plan`` (the CUDA checks only when ``cuda``; else their CLI is checked with ``--help``)."""
    outcomes = []
    for check in plan:
        argv = [a.replace("{out}", str(out)) for a in check.argv]
        command = " ".join(shlex.quote(a) for a in argv)
        if check.needs_cuda and not cuda:
            problem = parse_problem(argv)
            status = "skipped: needs CUDA; " + ("its command line parses" if problem is None
                                                else f"ITS COMMAND LINE DOES NOT PARSE: {problem}")
            outcomes.append(Outcome(check.name, status, command=command))
            continue
        started = time.monotonic()
        code, tail = _run(argv, check.timeout_s)
        status = "passed" if code == 0 else ("failed: over its time limit" if code is None else f"failed: exit {code}")
        outcomes.append(Outcome(check.name, status, time.monotonic() - started, command,
                                tail if code != 0 else []))
    return outcomes


def parse_problem(argv: Sequence[str]) -> Optional[str]:
    """None if a ``scaleloop`` command's flags parse (without running it), else what is wrong."""
    if tuple(argv[:3]) != SCALELOOP:
        return None   # pytest: its files are checked to exist by the test of this plan
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


def format_report(outcomes: Sequence[Outcome], device: str, cuda: bool, date: str) -> str:
    """The markdown report: a table of checks, what one GPU cannot show, and failures' output."""
    passed = sum(o.status == "passed" for o in outcomes)
    failed = [o for o in outcomes if o.status.startswith("failed")]
    lines = [f"# GPU check, {date}", "", f"- device: {device}",
             f"- mode: {'on CUDA' if cuda else 'CPU only (--cpu): CUDA checks skipped, their command lines checked'}",
             f"- {passed} passed, {len(failed)} failed, "
             f"{sum(o.status.startswith('skipped') for o in outcomes)} skipped, of {len(outcomes)}", "",
             "| check | result | seconds | command |", "| --- | --- | --- | --- |"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.1f} | `{o.command}` |" for o in outcomes]
    lines += ["", "## Not run: one GPU cannot show these", ""] + [f"- {item}" for item in NOT_RUN]
    for o in failed:
        lines += ["", f"## {o.name}: {o.status}", "", "```", *o.tail, "```"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m scaleloop.bench.gpucheck [--cpu] [--out DIR]``; exit 1 if a check failed."""
    parser = argparse.ArgumentParser(prog="python -m scaleloop.bench.gpucheck", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="no GPU here: skip the CUDA checks, check the rest")
    parser.add_argument("--out", default="benchmarks", help="where the report goes (default: benchmarks)")
    args = parser.parse_args(argv)
    import torch

    from scaleloop.bench.hardware import describe_hardware, hardware_slug

    cuda = torch.cuda.is_available() and not args.cpu
    out = Path(args.out)
    work = out / "gpu-check-work"
    work.mkdir(parents=True, exist_ok=True)
    outcomes = run_plan(work, cuda)
    hw = describe_hardware()
    date = time.strftime("%Y-%m-%d")
    device = torch.cuda.get_device_name(0) if cuda else "CPU (no CUDA)"
    report = out / f"{date}_{hardware_slug(hw, 'cuda' if cuda else 'cpu')}_gpu-check.md"
    report.write_text(format_report(outcomes, device, cuda, date))
    (report.with_suffix(".json")).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    print(f"gpu-check: wrote {report}")
    return 1 if any(o.status.startswith("failed") or "DOES NOT PARSE" in o.status for o in outcomes) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
