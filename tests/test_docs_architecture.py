"""docs/architecture.md says only what the code does: its measured numbers are recomputed here,
the route of one step it follows is run and traced, and the files it names exist.

- "Measured": each number of the table's "now" column is measured again from ``src/`` (modules,
  long functions, the import checks of tests/test_layout.py, where subcommands are registered,
  ``TrainConfig.validate``); a stale number fails.
- "One run followed through": every ``module:function`` the section names exists there; a
  one-step ``scaleloop train`` runs in this process under ``sys.setprofile``, and the section's
  numbered functions must be exactly scaleloop's frames on the stack when ``optimizer.step()``
  runs, and every function an item starts with must be first called in the page's order.
- Elsewhere on the page, every file named (``loop/trainer.py``, ``tests/test_layout.py``) exists.

The measuring code lives here, not in ``src/``: users never run it.
"""
from __future__ import annotations

import ast
import functools
import importlib
import re
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

import pytest

from test_layout import all_modules, import_graph, layer_breaches

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "scaleloop"
PAGE = ROOT / "docs" / "architecture.md"


def section(text: str, title: str) -> str:
    """The body of the page's ``## title`` section."""
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


# --- measuring the tree -----------------------------------------------------------------------
def lines_of(source: str) -> dict[str, int]:
    """Every function and method of ``source`` (nested ones too), ``line:name`` -> its lines, from
    its ``def`` to its last line, docstring and comments included (decorators not)."""
    return {f"{node.lineno}:{node.name}": node.end_lineno - node.lineno + 1   # type: ignore[operator]
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def function_lines(under: Path) -> dict[str, int]:
    """:func:`lines_of` every module under ``under``, keyed ``path:line:name``."""
    return {f"{path.relative_to(SRC)}:{name}": n for path in sorted(under.rglob("*.py"))
            for name, n in lines_of(path.read_text(encoding="utf-8")).items()}


def over(limit: int, under: Path) -> list[str]:
    return sorted(name for name, n in function_lines(under).items() if n > limit)


def subcommand_places() -> list[str]:
    """Where subcommands are registered: the packages (``commands/``) or top-level modules
    (``doctor.py``) holding a module that calls ``add_parser``."""
    places = set()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_parser"
               for n in ast.walk(tree)):
            relative = path.relative_to(SRC)
            places.add(f"{relative.parts[0]}/" if len(relative.parts) > 1 else relative.name)
    return sorted(places)


def validate_of_train_config() -> tuple[int, list[str]]:
    """``TrainConfig.validate``'s lines, and the settings it reads itself by name (``self.lr``)
    instead of leaving them to their section's ``check``."""
    from scaleloop.config import SETTINGS

    tree = ast.parse((SRC / "config" / "train_config.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    validate = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "validate")
    assert validate.end_lineno is not None
    read = sorted({n.attr for n in ast.walk(validate) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr in SETTINGS})
    return validate.end_lineno - validate.lineno + 1, read


@functools.lru_cache(maxsize=None)
def measured_now() -> dict[str, tuple[list[int], list[str]]]:
    """Each row of the table (by the start of its label) -> the numbers and the backticked names
    its "now" cell must hold, measured now (once a session: each measure reads and parses the whole
    tree, and the tree does not change while the tests run; read, never changed, by its callers)."""
    upward, mutual = layer_breaches(import_graph())
    places = subcommand_places()
    validate_lines, read_by_validate = validate_of_train_config()
    return {
        "parts that import each other": ([len(mutual)], []),
        "imports that go up a floor": ([len(upward)], []),
        "places that hold a subcommand": ([len(places)], places),
        "modules": ([len(all_modules())], []),
        "functions over 80 lines": ([len(over(80, SRC)), len(over(60, SRC / "loop"))], []),
        "`TrainConfig` fields": ([len(read_by_validate), validate_lines], ["validate"]),
    }


def table_rows(text: str) -> dict[str, str]:
    """The "Measured" table: each row's label -> its last ("now") cell."""
    rows = {}
    for line in section(text, "Measured").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] and not set(cells[0]) <= set("- "):
            rows[cells[0]] = cells[2]
    return rows


def stale_numbers(text: str) -> list[str]:
    """Where the page's "now" column and the tree part, one line each."""
    rows, problems = table_rows(text), []
    for start, (numbers, names) in measured_now().items():
        label = next((label for label in rows if label.startswith(start)), None)
        if label is None:
            problems.append(f"no row starting {start!r}")
            continue
        cell = rows[label]
        shown = [int(n) for n in re.findall(r"\d+", cell)]
        if shown != numbers or not all(f"`{name}`" in cell for name in names):
            problems.append(f"{label}: the page says {cell!r}; the tree has {numbers} {names or ''}".rstrip())
    measured = set(measured_now())
    problems += [f"a row nothing measures: {label!r}" for label in rows
                 if not any(label.startswith(start) for start in measured)]
    return problems


def test_every_measured_number_is_todays() -> None:
    problems = stale_numbers(PAGE.read_text(encoding="utf-8"))
    assert not problems, "docs/architecture.md's Measured table is stale:\n" + "\n".join("  " + p for p in problems)


def test_a_stale_number_is_found() -> None:
    text = PAGE.read_text(encoding="utf-8")
    modules = len(all_modules())
    stale = text.replace(f"| modules | 116 | {modules} |", f"| modules | 116 | {modules - 1} |")
    assert stale != text
    assert [p.split(":")[0] for p in stale_numbers(stale)] == ["modules"]


def test_a_functions_lines_run_from_def_to_its_last_line() -> None:
    source = '@decorated\ndef f():\n    """Doc."""\n    # why\n\n    def g():\n        return 1\n    return g\n'
    assert lines_of(source) == {"2:f": 7, "6:g": 2}


# --- the route of one step ----------------------------------------------------------------------
NAMED = re.compile(r"`(scaleloop(?:\.\w+)+):([\w.]+)`")


def route(text: str) -> tuple[list[str], list[str]]:
    """The route the page gives: its numbered functions (the stack at ``optimizer.step()``), and
    every item's leading function, numbered and bulleted, in the page's order."""
    numbered, items = [], []
    for line in section(text, "One run followed through").splitlines():
        item = re.match(r"^(\d+\.|\s+-) `(scaleloop[\w.]*:[\w.]+)`", line)
        if item:
            items.append(item.group(2))
            if item.group(1)[0].isdigit():
                numbered.append(item.group(2))
    return numbered, items


def resolve(named: str) -> Any:
    module, qualname = named.split(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def test_every_function_the_section_names_is_where_it_says() -> None:
    text = section(PAGE.read_text(encoding="utf-8"), "One run followed through")
    named = [f"{m}:{q}" for m, q in NAMED.findall(text)]
    assert len(named) >= 10, named
    missing = []
    for name in named:
        try:
            resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert not missing, f"named in docs/architecture.md but not in the code: {missing}"


def trace_one_step(argv: list[str]) -> tuple[list[str], list[str]]:
    """Run ``scaleloop <argv>`` here under ``sys.setprofile``, up to the first ``optimizer.step()``.

    Returns every scaleloop function called before it, as ``module:qualname`` in the order of
    their first calls, and scaleloop's frames on the stack at that ``optimizer.step()``, outermost
    first."""
    import torch

    from scaleloop.cli import main

    prefix = str(SRC)
    first_calls: dict[str, None] = {}
    at_step: list[str] = []

    def name_of(frame: FrameType) -> str:
        return f"{frame.f_globals.get('__name__')}:{frame.f_code.co_qualname}"

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or at_step:
            return
        code = frame.f_code
        if code.co_filename.startswith(prefix):
            first_calls.setdefault(name_of(frame), None)
        elif code.co_name == "step" and isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
            outer: Optional[FrameType] = frame
            while outer is not None:
                if outer.f_code.co_filename.startswith(prefix):
                    at_step.insert(0, name_of(outer))
                outer = outer.f_back

    sys.setprofile(profile)
    try:
        code = main(argv)
    finally:
        sys.setprofile(None)
    assert code == 0
    assert at_step, "optimizer.step() was never called"
    return list(first_calls), at_step


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[str]]:
    out = tmp_path_factory.mktemp("route") / "run"
    return trace_one_step(["train", "--data", "random", "--n-samples", "64", "--batch-size", "32", "--max-steps", "1",
                           "--no-progress", "--no-tensorboard", "--device", "cpu", "--out", str(out)])


def test_the_numbered_functions_are_the_stack_at_the_optimizer_step(traced: tuple[list[str], list[str]]) -> None:
    numbered, _ = route(PAGE.read_text(encoding="utf-8"))
    _, at_step = traced
    assert numbered == at_step


def test_every_function_of_the_route_is_called_in_the_pages_order(traced: tuple[list[str], list[str]]) -> None:
    _, items = route(PAGE.read_text(encoding="utf-8"))
    called, _ = traced
    assert [name for name in items if name not in called] == []
    assert sorted(items, key=called.index) == items


def test_the_route_reader_finds_numbers_and_bullets() -> None:
    text = ("\n## One run followed through\n\n1. `scaleloop.cli:main`: a.\n   - `scaleloop.config:resolve`: b,"
            " not `scaleloop.x:y`.\n2. `scaleloop.loop.step:train_step`: c.\n\nThe named types\n")
    assert route(text) == (["scaleloop.cli:main", "scaleloop.loop.step:train_step"],
                           ["scaleloop.cli:main", "scaleloop.config:resolve", "scaleloop.loop.step:train_step"])


# --- files the page names -----------------------------------------------------------------------
def test_every_file_the_page_names_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    # The "before" column names the files of an older tree, on purpose.
    text = text.split("\n## Measured\n", 1)[0]
    named = set(re.findall(r"`((?:[\w.]+/)*[\w.]+\.py|(?:[\w.]+/)+)`", text))
    assert len(named) > 20
    # Named from the package (``loop/step.py``), from ``src/`` (``scaleloop/__init__.py``) or from the root.
    missing = sorted(name for name in named if not any((base / name).exists() for base in (SRC, SRC.parent, ROOT)))
    assert not missing, f"files docs/architecture.md names that do not exist: {missing}"
