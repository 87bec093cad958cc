"""``benchmarks/README.md``: an index of the dated results in a directory, rebuilt from their JSON.

Quick (CI-sized) results are left out: they are not results to quote.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scaleloop.bench.hardware import hardware_line

INTRO = """# Benchmark results

Dated results of `scaleloop bench` (see [docs/benchmarking.md](../docs/benchmarking.md) for what
each command measures and how). Each result is three files with one stem,
`<date>_<hardware>_<what>[-<tag>]`: `.md` (tables, hardware, command, notes), `.json` (every
number) and `.png` (chart). This index is rebuilt by `scaleloop bench index`.

The `peers` results compare scaleloop with a raw PyTorch loop, HuggingFace Accelerate and
Lightning Fabric; they come from [`peers/run.py`](peers/README.md), which runs in an
environment of its own (Accelerate and Lightning are not scaleloop's dependencies).
"""


def collect(directory: Path) -> list[dict[str, Any]]:
    """The non-quick results in ``directory``, newest first, then by hardware and name."""
    results = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(data, dict) or "what" not in data or data.get("quick"):
            continue
        data["_stem"] = path.stem
        results.append(data)
    results.sort(key=lambda d: (d.get("date", ""), d.get("hardware_slug", ""), d["_stem"]), reverse=True)
    return results


def render(results: list[dict[str, Any]]) -> str:
    lines = [INTRO]
    if not results:
        return "\n".join(lines + ["No results yet."]) + "\n"
    lines += ["| date | hardware | benchmark | headline | files |", "| --- | --- | --- | --- | --- |"]
    machines: dict[str, dict[str, set[str]]] = {}
    for r in results:
        stem = r["_stem"]
        files = f"[md]({stem}.md), [json]({stem}.json)" + (f", [png]({stem}.png)" if r.get("has_png", True) else "")
        lines.append(f"| {r.get('date', '')} | {r.get('hardware_slug', '')} | {r.get('title', r['what'])} | "
                     f"{(r.get('headline') or '').replace('|', '/')} | {files} |")
        # A slug names a class of machine (e.g. cpu-2core); different machines may share it.
        seen = machines.setdefault(r.get("hardware_slug", ""), {})
        seen.setdefault(hardware_line(r["hardware"]), set()).add(r.get("date", ""))
    lines += ["", "## Machines", ""]
    for slug, descriptions in sorted(machines.items()):
        for line, dates in sorted(descriptions.items()):
            when = f" (runs of {', '.join(sorted(dates))})" if len(descriptions) > 1 else ""
            lines.append(f"- `{slug}`: {line}{when}")
    if not any(r["hardware"].get("gpus") for r in results):
        lines += ["", "No GPU results yet: no GPU was available to the runs above. On a GPU machine, the same "
                      "commands measure the GPUs (see docs/benchmarking.md)."]
    return "\n".join(lines) + "\n"


def write_index(directory: Path) -> Path:
    """Rebuild ``directory/README.md`` from the results in it; returns its path."""
    results = collect(directory)
    for r in results:
        r["has_png"] = (directory / f"{r['_stem']}.png").exists()
    text = render(results)
    path = directory / "README.md"
    path.write_text(text, encoding="utf-8")
    return path
