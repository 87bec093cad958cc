"""Synchronous against background checkpoints (``--async-checkpoint``), side by side in one session.

    python benchmarks/async_checkpoint/run.py [--reps 2] [--hidden-dim 100000] [--out DIR]

Each run is ``scaleloop train`` as a user starts it: SimpleNet on random data with 1,024 inputs and
80,000 hidden units (82.8 M parameters; with Adam a checkpoint of 0.99 GB: model and both moments), ``--nproc 2``,
``--checkpoint-every 2``, 8 steps (checkpoints after steps 2, 4, 6 and the epoch's end, 8),
``--log-every 1``. For ddp and fsdp, three modes: no checkpoints (the baseline of memory), synchronous,
and ``--async-checkpoint``; the modes alternate within each repetition (A B C A B C ...), since the
machine is shared and its load drifts. Medians over the repetitions are reported.

Measured per run:

- the wall time of the steps right after a checkpoint inside the epoch (steps 3, 5, 7: from the log
  row of the step before to that step's row, so the checkpoint's pause is inside it) against the
  other steps (2, 4, 6, 8 without one before; step 1 warms up and is left out);
- the checkpoints' seconds the summary prints (what training paused for them; with a thread, also
  the writes' own time in the background), and the run's wall time;
- the peak host memory: every process of the run (launcher, torchrun, workers) read from
  ``/proc/PID/status`` every 50 ms, their resident anonymous memory (``RssAnon``: the tensors and
  buffers, not the shared libraries) summed; the peak of that sum, and what it adds to the run
  without checkpoints;
- the load average before and after.

Writes ``results.json`` into ``--out`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODES = {"none": ["--no-checkpoints"], "sync": [], "async": ["--async-checkpoint"]}
AFTER_CHECKPOINT = (3, 5, 7)
OTHER = (2, 4, 6, 8)


def settings(hidden: int) -> list[str]:
    return ["--data", "random", "--input-dim", "1024", "--hidden-dim", str(hidden), "--n-samples", "512",
            "--batch-size", "64", "--epochs", "1", "--checkpoint-every", "2",
            "--log-every", "1", "--keep-checkpoints", "2", "--nproc", "2", "--device", "cpu", "--no-progress",
            "--no-tensorboard", "--tracker", "none"]


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (torchrun's workers run in sessions of their own, but
    stay its children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def rss_anon(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    m = re.search(r"^RssAnon:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


class PeakMemory(threading.Thread):
    """The peak of the summed ``RssAnon`` of a process tree, sampled every 50 ms."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.done = root, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, sum(rss_anon(pid) for pid in descendants(self.root)))


def one_run(strategy: str, mode: str, hidden: int, out: Path) -> dict:
    run_dir = out / f"{strategy}-{mode}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "scaleloop", "train", *settings(hidden), "--strategy", strategy,
           *MODES[mode], "--out", str(run_dir)]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    watch = PeakMemory(proc.pid)
    watch.start()
    text, _ = proc.communicate(timeout=1200)
    watch.done.set()
    watch.join()
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{text[-3000:]}")
    walls = {}
    with open(run_dir / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            if row["kind"] == "step":
                walls[int(row["step"])] = float(row["wall_s"])
    step_s = {s: walls[s] - walls[s - 1] for s in walls if s - 1 in walls}
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("checkpoints")), "")
    # "4 written (21.4 s)", or "... (10.0 s of training, writes 1 min 02 s)"
    seconds = [60 * int(m or 0) + float(x) for m, x in re.findall(r"(?:(\d+) min )?([\d.]+) s", line)]
    subprocess.run(["rm", "-rf", str(run_dir)], check=False)
    return {"strategy": strategy, "mode": mode, "wall_s": wall, "peak_bytes": watch.peak,
            "after_checkpoint_s": statistics.median(step_s[s] for s in AFTER_CHECKPOINT),
            "other_step_s": statistics.median(step_s[s] for s in OTHER),
            "checkpoint_line": line.strip(), "paused_s": seconds[0] if seconds else 0.0,
            "background_s": seconds[1] if len(seconds) > 1 else 0.0,
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--hidden-dim", type=int, default=80_000)
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="async-ckpt-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for rep in range(args.reps):
        for strategy in args.strategies.split(","):
            for mode in MODES:   # alternating: none, sync, async, none, sync, async ...
                result = one_run(strategy, mode, args.hidden_dim, out)
                result["rep"] = rep
                results.append(result)
                print(json.dumps(result), flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n| strategy | mode | step after a checkpoint (s) | other steps (s) | training paused for checkpoints (s) "
          "| writes in the background (s) | run wall (s) | peak host memory (GiB) | added by checkpoints (GiB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for strategy in args.strategies.split(","):
        base = statistics.median(r["peak_bytes"] for r in results if r["strategy"] == strategy and r["mode"] == "none")
        for mode in MODES:
            rs = [r for r in results if r["strategy"] == strategy and r["mode"] == mode]
            med = {k: statistics.median(r[k] for r in rs) for k in
                   ("after_checkpoint_s", "other_step_s", "paused_s", "background_s", "wall_s", "peak_bytes")}
            print(f"| {strategy} | {mode} | {med['after_checkpoint_s']:.2f} | {med['other_step_s']:.2f} | "
                  f"{med['paused_s']:.1f} | {med['background_s']:.1f} | {med['wall_s']:.1f} | "
                  f"{med['peak_bytes'] / 2**30:.2f} | {(med['peak_bytes'] - base) / 2**30:+.2f} |")
    loads = [r["load_before"] for r in results] + [r["load_after"] for r in results]
    print(f"\nload average (1 min) over the runs: {min(loads):.2f} to {max(loads):.2f}; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
