"""What the garbage collector costs a process while it imports torch and ``torch._dynamo``.

    python benchmarks/launch/collector.py [--runs 7]

Each run is a fresh interpreter that imports torch and ``torch._dynamo`` (which ``torch.optim``
and ``DistributedDataParallel`` import when built) and makes an Adam optimizer, timed inside with
``time.process_time``: once with the collector as Python leaves it, once inside
``scaleloop.runtime.collector.collection_paused``. The two kinds run in turn; the table gives each one's median CPU seconds and its full collections.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = """
import contextlib, gc, json, sys, time
full = []
gc.callbacks.append(lambda phase, info: full.append(1) if phase == "start" and info["generation"] == 2 else None)
from scaleloop.runtime.collector import collection_paused
start = time.process_time()
with (collection_paused() if sys.argv[1] == "paused" else contextlib.nullcontext()):
    import torch
    import torch._dynamo
    torch.optim.Adam(torch.nn.Linear(4, 4).parameters())
print(json.dumps({"cpu_s": time.process_time() - start, "full_collections": len(full)}))
"""


def one(kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    one("as-is"), one("paused")   # warm-up: the page cache
    runs: dict[str, list[dict]] = {"as-is": [], "paused": []}
    for _ in range(args.runs):
        for kind in runs:
            runs[kind].append(one(kind))
    print("| collector | median CPU s | min | max | full collections |\n| --- | ---: | ---: | ---: | ---: |")
    for kind, results in runs.items():
        cpu = [r["cpu_s"] for r in results]
        print(f"| {kind} | {statistics.median(cpu):.3f} | {min(cpu):.3f} | {max(cpu):.3f} | "
              f"{statistics.median(r['full_collections'] for r in results):.0f} |")
    paired = [a["cpu_s"] - b["cpu_s"] for a, b in zip(runs["as-is"], runs["paused"])]
    print(f"\nas-is minus paused, pair by pair: median {statistics.median(paired):.3f} CPU s "
          f"(min {min(paired):.3f}, max {max(paired):.3f}), {args.runs} pairs")


if __name__ == "__main__":
    main()
