"""Launch time: ``scaleloop train --max-steps 1`` against a bare torchrun script, paired.

    python benchmarks/launch/run.py [--runs 5] [--nproc 2] [--baseline allreduce|ddp]

Runs the two commands in turn (one warm-up each, then A B A B ...), each a whole process timed
from the outside (wall clock; user + system CPU of it and its children, from ``os.wait4``), and
prints each figure's min, median and max and the ratio A/B pair by pair. The bare script is
what torchrun needs to start N workers that meet: ``init_process_group("gloo")``, one
``all_reduce`` of one element, ``destroy_process_group()``. With ``--baseline ddp`` the bare
script is instead the smallest hand-written DDP step: a ``DistributedDataParallel(Linear)``, an
SGD optimizer, one forward, backward and step. Both ``DistributedDataParallel`` and every
``torch.optim`` optimizer import ``torch._dynamo`` when built (about 1 s of CPU a process), which
the all-reduce script never pays. Each scaleloop run writes a fresh run directory; the output of
both is thrown away.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = """import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""

BARE_DDP = """import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(20, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 20)).square().mean().backward()
optimizer.step()
dist.destroy_process_group()
"""


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user + system, the process and its children) of one run of ``cmd``."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}")
    return wall, usage.ru_utime + usage.ru_stime


def row(name: str, values: list[float], unit: str = "") -> str:
    return f"| {name} | {min(values):.3f}{unit} | {statistics.median(values):.3f}{unit} | {max(values):.3f}{unit} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--baseline", choices=("allreduce", "ddp"), default="allreduce",
                        help="the bare script: one all-reduce, or one hand-written DDP step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="launch-bench-") as tmp:
        bare = Path(tmp, "bare.py")
        bare.write_text(BARE if args.baseline == "allreduce" else BARE_DDP)
        b_cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", "--standalone",
                 str(bare)]
        nproc = ["--nproc", str(args.nproc)] if args.nproc > 1 else []

        def a_cmd(i: int) -> list[str]:
            return [sys.executable, "-m", "scaleloop", "train", *nproc, "--data", "random", "--max-steps", "1",
                    "--no-progress", "--no-tensorboard", "--out", str(Path(tmp, f"run-{i}"))]

        timed(a_cmd(-1))   # warm-up: the page cache, as for every later run
        timed(b_cmd)
        a, b = [], []
        for i in range(args.runs):
            a.append(timed(a_cmd(i)))
            b.append(timed(b_cmd))
    print(f"A = scaleloop train {' '.join(nproc)} --data random --max-steps 1 ...; B = bare torchrun "
          f"({args.baseline}), --nproc-per-node {args.nproc}; {args.runs} runs each, in turn, after one warm-up\n")
    print("| figure | min | median | max |\n| --- | ---: | ---: | ---: |")
    print(row("A wall s", [w for w, _ in a]))
    print(row("A cpu s", [c for _, c in a]))
    print(row("B wall s", [w for w, _ in b]))
    print(row("B cpu s", [c for _, c in b]))
    print(row("A/B wall", [x[0] / y[0] for x, y in zip(a, b)], "x"))
    print(row("A/B cpu", [x[1] / y[1] for x, y in zip(a, b)], "x"))


if __name__ == "__main__":
    main()
