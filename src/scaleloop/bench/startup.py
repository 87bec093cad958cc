"""``scaleloop bench overhead --mode startup``: what ``import scaleloop`` and ``scaleloop --help`` cost.

Every measurement is a fresh interpreter (``sys.executable``), timed from start to exit; the
commands are run in a rotating order in each repetition, so that a slow moment of the machine
hits them alike. ``import torch`` is the baseline: scaleloop is a torch library, and what it
adds is the difference. Each command also reports which heavy optional modules it loaded
(matplotlib, TensorBoard, scikit-learn, tqdm), and ``python -X importtime`` names the slowest
of scaleloop's own modules.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

from scaleloop.bench.hardware import describe_hardware, hardware_slug
from scaleloop.bench.report import BenchReport, Column, Table
from scaleloop.bench.stats import summarize

Say = Callable[[str], None]

#: Loaded only by the parts that need them (plots, TensorBoard, the digits dataset, progress bar).
HEAVY = ("matplotlib", "tensorboard", "torch.utils.tensorboard", "sklearn", "tqdm")

_PROBE = "import sys, json; print('SCALELOOP_MODULES=' + json.dumps(sorted(m for m in {heavy} if m in sys.modules)))"

#: (name, python code or argv after the interpreter, what it shows)
COMMANDS: tuple[tuple[str, list[str], str], ...] = (
    ("import torch", ["-c", "import torch"], "the baseline"),
    ("import torch, scaleloop", ["-c", "import torch, scaleloop"], "what `import scaleloop` adds to a torch program"),
    ("import scaleloop", ["-c", "import scaleloop"], "the package alone (its API loads on first use)"),
    ("import scaleloop; scaleloop.train", ["-c", "import scaleloop; scaleloop.train"],
     "the whole training library loaded (loop, strategies, checkpoints, data, models)"),
    ("scaleloop --help", ["-m", "scaleloop", "--help"], "the CLI's help"),
    ("scaleloop train --help", ["-m", "scaleloop", "train", "--help"], "every training flag"),
)


def _env(bytecode_cache: bool = True) -> dict[str, str]:
    """This process's environment, with this scaleloop first on the path of the child interpreters
    and Python's bytecode cache on: start-up is measured as after ``pip install``, which compiles
    every module once. Where ``PYTHONDONTWRITEBYTECODE`` is set, the children may write the
    cache after all (next to the sources, where Python keeps it), or every run would compile
    scaleloop's sources again. Not in a directory of its own (``PYTHONPYCACHEPREFIX``): an empty
    one would have the warm-up compile all of torch too (about a minute on 2 cores)."""
    import scaleloop

    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.abspath(scaleloop.__file__)))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _time(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def loaded_modules(argv: list[str], env: dict[str, str]) -> list[str]:
    """Which of :data:`HEAVY` (and torch) the command has imported when it is done."""
    probe = _PROBE.format(heavy=repr(HEAVY + ("torch",)))
    if argv[0] == "-c":
        code = argv[1] + "\n" + probe
    else:  # -m scaleloop ...: run the CLI, then look (SystemExit from argparse's --help is caught)
        code = (f"import sys\nsys.argv = ['scaleloop', *{argv[2:]!r}]\nfrom scaleloop.cli import main\n"
                f"try:\n    main()\nexcept SystemExit:\n    pass\n{probe}")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("SCALELOOP_MODULES="))
    return json.loads(line.split("=", 1)[1])


def added_import_time(env: dict[str, str]) -> dict[str, float]:
    """Seconds that scaleloop adds to a process that has imported torch, from one
    ``python -X importtime -c "import torch; import scaleloop; scaleloop.train"``: the import
    times of their own (self) of every module imported after torch, summed — for ``import
    scaleloop`` alone and for the whole training library (which ``scaleloop.train`` loads).

    Measured inside one interpreter, this is far less noisy than the difference of two
    interpreters' wall-clock times on a busy machine."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch; import scaleloop; scaleloop.train"],
                         env=env, check=True, capture_output=True, text=True)
    after_torch, package, library = False, 0.0, 0.0
    for line in res.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        if after_torch:
            library += int(parts[0]) / 1e6
            if parts[2] == "scaleloop":
                package = library      # everything up to the end of `import scaleloop`
        elif parts[2] == "torch":
            after_torch = True
    return {"package_s": package, "library_s": library}


def slowest_imports(env: dict[str, str], n: int = 8) -> list[dict[str, Any]]:
    """scaleloop's own modules by their import time of their own (``-X importtime``, self us)."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import scaleloop; scaleloop.train"],
                         env=env, check=True, capture_output=True, text=True)
    rows = []
    for line in res.stderr.splitlines():
        parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
        if len(parts) == 3 and parts[2].startswith("scaleloop") and parts[0].isdigit():
            rows.append({"module": parts[2], "self_ms": int(parts[0]) / 1e3, "cumulative_ms": int(parts[1]) / 1e3})
    return sorted(rows, key=lambda r: -r["self_ms"])[:n]


def run_startup(opts: Any, say: Say) -> BenchReport:
    hw = describe_hardware()
    env = _env()
    repeats = opts.repeats
    names = [c[0] for c in COMMANDS]
    argv = {c[0]: c[1] for c in COMMANDS}
    times: dict[str, list[float]] = {n: [] for n in names}
    say(f"startup: {len(names)} commands x {repeats} repetitions, fresh interpreters, rotating order")
    if not opts.quick:   # --quick makes no timing claim: its one repetition goes without a warm-up
        for name in names:   # warm the file system and bytecode caches, not counted
            _time(argv[name], env)
        added_import_time(env)
    added: list[dict[str, float]] = []
    for i in range(repeats):
        jobs = names + ["importtime"]
        k = i % len(jobs)
        for name in jobs[k:] + jobs[:k]:
            if name == "importtime":
                added.append(added_import_time(env))
            else:
                times[name].append(_time(argv[name], env))
        say(f"  repetition {i + 1}/{repeats}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names)
            + f", scaleloop's imports after torch {added[-1]['library_s']:.3f} s")
    stats = {n: summarize(v) for n, v in times.items()}
    package = summarize([a["package_s"] for a in added])
    library = summarize([a["library_s"] for a in added])
    modules = {n: loaded_modules(argv[n], env) for n in names}
    base = stats["import torch"]["median"]
    rows = []
    for name, _argv, what in COMMANDS:
        s = stats[name]
        rows.append({"command": name, "median_s": s["median"], "min_s": s["min"], "max_s": s["max"],
                     "spread": s["spread"], "over_torch_s": s["median"] - base, "what": what,
                     "torch": "yes" if "torch" in modules[name] else "no",
                     "heavy": ", ".join(m for m in modules[name] if m != "torch") or "none"})
    table = Table("Start-up, fresh interpreters, interleaved repetitions", [
        Column("command", "command"), Column("median_s", "median s", _s), Column("min_s", "min s", _s),
        Column("max_s", "max s", _s), Column("spread", "spread (max-min)/median", lambda v: f"{100 * v:.0f}%"),
        Column("over_torch_s", "- import torch (s)", lambda v: f"{v:+.3f}"), Column("torch", "loads torch"),
        Column("heavy", "optional modules loaded"), Column("what", "what it shows")], rows,
        f"{repeats} repetitions of each command; python {sys.version.split()[0]} ({sys.executable}).")
    importtime = Table("What scaleloop adds to a process that has imported torch (python -X importtime)", [
        Column("what", "import"), Column("median_s", "median s", _s), Column("min_s", "min s", _s),
        Column("max_s", "max s", _s)],
        [{"what": "import scaleloop", **_row(package)},
         {"what": "import scaleloop; scaleloop.train (the whole training library)", **_row(library)}],
        f"{repeats} runs of `python -X importtime -c \"import torch; import scaleloop; scaleloop.train\"`, "
        "interleaved with the commands above; each the sum of the import times of their own of every module "
        "imported after torch (scaleloop's, and the few standard-library modules torch had not loaded).")
    slow = slowest_imports(env)
    imports = Table("scaleloop's slowest modules to import (python -X importtime, one run)", [
        Column("module", "module"), Column("self_ms", "self ms", lambda v: f"{v:.1f}"),
        Column("cumulative_ms", "with its imports ms", lambda v: f"{v:.1f}")], slow,
        "Self time excludes the modules each one imports (torch above all).")
    adds, full = package["median"], library["median"]
    helps = stats["scaleloop --help"]["median"]
    report = BenchReport(
        what="startup", title="Start-up: import scaleloop and scaleloop --help", hardware=hw,
        slug=hardware_slug(hw, "cpu"), command=opts.command,
        settings={"repeats": repeats, "python": sys.executable}, tables=[importtime, table, imports],
        quick=opts.quick,
        data={"seconds": stats, "modules": modules, "slowest_imports": slow, "import_adds_s": adds,
              "library_adds_s": full, "help_s": helps, "added_by_importtime": {"package": package, "library": library},
              "repetitions": times, "importtime_runs": added})
    report.headline = (f"import scaleloop adds {adds:.3f} s to import torch ({full:.3f} s with the whole training "
                       f"library loaded); scaleloop --help answers in {helps:.2f} s "
                       f"{'without' if modules['scaleloop --help'] == [] else 'with'} torch")
    report.notes = [
        "Bytecode cached, as after pip install (filled by the untimed warm-up runs where it was not); "
        "with PYTHONDONTWRITEBYTECODE=1 every start compiles scaleloop's sources again, about 0.1 s more for "
        "the whole library on this machine.",
        "`import scaleloop` loads no torch: the public names are resolved on first use (PEP 562), and the CLI "
        "imports torch only inside the subcommands, so `--help` and flag errors answer at once.",
        "matplotlib (curves), TensorBoard (event files), scikit-learn (the digits dataset) and tqdm (the "
        "progress bar) are imported only where they are used; torch itself imports tqdm.",
        "The wall-clock column '- import torch' subtracts the medians of separate interpreters, whose start-up "
        "alone varies by more than scaleloop's imports on a loaded machine (see the spread and the load "
        "average); the -X importtime table measures the addition inside one interpreter instead.",
    ]
    return report


def _row(s: dict[str, float]) -> dict[str, float]:
    return {"median_s": s["median"], "min_s": s["min"], "max_s": s["max"]}


def _s(v: float) -> str:
    return f"{v:.3f}"
