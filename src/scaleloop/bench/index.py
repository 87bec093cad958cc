"""``benchmarks/README.md``: an index of the dated results in a directory, rebuilt from their files.

The results at the top of the directory are the current ones: each benchmark's newest run. The
runs a newer one replaced are kept in ``history/`` below it (moved there by hand, ``git mv``,
when the rerun is committed); ``history/README.md`` indexes them the same way, and the main
index points at it. Quick (CI-sized) results are left out: they are not results to quote.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from scaleloop.bench.hardware import hardware_line

HISTORY = "history"

INTRO = """# Benchmark results

Dated results of `scaleloop bench` (see [docs/benchmarking.md](../docs/benchmarking.md) for what
each command measures and how). Each result is three files with one stem,
`<date>_<hardware>_<what>[-<tag>]`: `.md` (tables, hardware, command, notes), `.json` (every
number) and `.png` (chart). This index is rebuilt by `scaleloop bench index`.

The `peers` results compare scaleloop with a raw PyTorch loop, HuggingFace Accelerate and
Lightning Fabric; they come from [`peers/run.py`](peers/README.md), which runs in an
environment of its own (Accelerate and Lightning are not scaleloop's dependencies).
"""

HISTORY_INTRO = """# Superseded benchmark results

Runs that a newer result of the same benchmark (the same command, workload and machine) has
replaced; the current ones are in [the directory above](../README.md). They stay because the
docs tell how a result came about, run by run. This index is rebuilt by `scaleloop bench index`.
"""

#: ``<date>_<hardware>_<what>``: a result's file name (a notes file has another).
_STEM = re.compile(r"^(\d{4}-\d{2}-\d{2})_([^_]+)_(.+)$")


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


def notes(directory: Path, results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The dated markdown results with no result JSON of their own (measured by a script, written by
    hand), newest first: their date, hardware and title (the first heading)."""
    have_json = {r["_stem"] for r in results}
    found = []
    for path in sorted(directory.glob("*.md"), reverse=True):
        named = _STEM.match(path.stem)
        if named is None or path.stem in have_json or path.stem.endswith("-quick"):
            continue
        heading = next((line[2:].strip() for line in path.read_text(encoding="utf-8").splitlines()
                        if line.startswith("# ")), path.stem)
        found.append({"date": named.group(1), "hardware_slug": named.group(2), "title": heading,
                      "stem": path.stem})
    return found


def render(results: list[dict[str, Any]], notes_found: list[dict[str, str]] = (), intro: str = INTRO,
           history: int = 0) -> str:
    """The index's text: ``results`` in a table, the markdown-only ``notes_found`` after it, the
    machines; ``history``: how many superseded results ``history/`` holds (0: no pointer)."""
    lines = [intro]
    if not results and not notes_found:
        lines.append("No results yet.")
    if results:
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
    if notes_found:
        lines += ["", "## Measured by scripts or by hand (markdown only)", "",
                  "| date | hardware | what | file |", "| --- | --- | --- | --- |"]
        lines += [f"| {n['date']} | {n['hardware_slug']} | {n['title'].replace('|', '/')} | [md]({n['stem']}.md) |"
                  for n in notes_found]
    if history:
        lines += ["", "## Superseded runs", "",
                  f"{history} earlier run{'s' if history != 1 else ''} that a result above replaced (the same "
                  f"benchmark, rerun): [{HISTORY}/]({HISTORY}/README.md), with an index of its own."]
    if machines:
        lines += ["", "## Machines", ""]
    for slug, descriptions in sorted(machines.items()):
        for line, dates in sorted(descriptions.items()):
            when = f" (runs of {', '.join(sorted(dates))})" if len(descriptions) > 1 else ""
            lines.append(f"- `{slug}`: {line}{when}")
    if results and not any(r["hardware"].get("gpus") for r in results):
        lines += ["", "No GPU results yet: no GPU was available to the runs above. On a GPU machine, the same "
                      "commands measure the GPUs (see docs/benchmarking.md)."]
    return "\n".join(lines) + "\n"


def _index(directory: Path, intro: str, history: int = 0) -> tuple[Path, int]:
    """Write ``directory/README.md``; returns its path and how many results it lists."""
    results = collect(directory)
    for r in results:
        r["has_png"] = (directory / f"{r['_stem']}.png").exists()
    found = notes(directory, results)
    path = directory / "README.md"
    path.write_text(render(results, found, intro, history), encoding="utf-8")
    return path, len(results) + len(found)


def write_index(directory: Path) -> Path:
    """Rebuild ``directory/README.md`` from the current results in it (and ``history/README.md``
    from the superseded ones, where that folder exists); returns the main index's path."""
    superseded = 0
    if (directory / HISTORY).is_dir():
        _, superseded = _index(directory / HISTORY, HISTORY_INTRO)
    path, _ = _index(directory, INTRO, superseded)
    return path
