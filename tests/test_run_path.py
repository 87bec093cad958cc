"""docs/architecture.md's "One run followed through" lists the named types a reader meets from
``scaleloop train`` to ``optimizer.step()``; this checks that list against the code.

The path is the functions a ``scaleloop train --nproc N`` run goes through, in order. A type is
"met" on the path when one of those functions names it in its code (constructs it, calls it,
checks against it; annotations and exceptions aside), as resolved through the function's
module and its own imports. The doc must list exactly those types, in the order the path first
meets them, and no more than 16. (15 until the loop's own bookkeeping left ``RunResult``: the
straggler watch it carried unseen, ``Stragglers``, is now named where the trainer makes it.)
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 16

#: (module, function) from ``scaleloop train`` to ``optimizer.step()``.
PATH = (
    ("scaleloop.cli", "main"),
    ("scaleloop.commands.train", "run"),
    ("scaleloop.config.saved_settings", "config_for_resume"),
    ("scaleloop.launching.launcher", "launch_train"),
    ("scaleloop.launching.launcher", "_launch_workers"),
    ("scaleloop.launching.launcher", "_run_workers"),
    ("scaleloop.loop.training", "train"),
    ("scaleloop.loop.build", "build_run"),
    ("scaleloop.strategies.factory", "build_strategy"),
    ("scaleloop.loop.trainer", "Trainer.__init__"),
    ("scaleloop.loop.trainer", "Trainer.fit"),
    ("scaleloop.loop.trainer", "Trainer.train_epoch"),
    ("scaleloop.loop.step", "train_step"),
    ("scaleloop.strategies.precision", "Precision.step"),   # where optimizer.step() is called
)


def _annotation_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                if arg.annotation is not None:
                    ids.update(id(n) for n in ast.walk(arg.annotation))
            if node.returns is not None:
                ids.update(id(n) for n in ast.walk(node.returns))
        elif isinstance(node, ast.AnnAssign):
            ids.update(id(n) for n in ast.walk(node.annotation))
    return ids


def _resolve(node: ast.AST, namespace: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, namespace)
        return getattr(owner, node.attr, None) if inspect.ismodule(owner) else None
    return None


def types_met() -> list[str]:
    """The scaleloop types the path's functions name, in the order the path first meets them."""
    met: list[str] = []
    for module_name, qualname in PATH:
        module = importlib.import_module(module_name)
        function: Any = module
        for part in qualname.split("."):
            function = getattr(function, part)
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        namespace = dict(vars(module))
        for node in ast.walk(tree):   # the function's own imports
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("scaleloop"):
                imported = importlib.import_module(node.module)
                namespace.update({a.asname or a.name: getattr(imported, a.name, None) for a in node.names})
            elif isinstance(node, ast.Import):
                namespace.update({a.asname or a.name: importlib.import_module(a.name) for a in node.names
                                  if a.name.startswith("scaleloop")})
        skip = _annotation_nodes(tree)
        found = [(getattr(node, "lineno", 0), getattr(node, "col_offset", 0), _resolve(node, namespace))
                 for node in ast.walk(tree) if id(node) not in skip and isinstance(node, (ast.Name, ast.Attribute))]
        for _, _, obj in sorted(found, key=lambda f: (f[0], f[1])):
            if (inspect.isclass(obj) and obj.__module__.startswith("scaleloop")
                    and not issubclass(obj, BaseException) and obj.__name__ not in met):
                met.append(obj.__name__)
    return met


def documented() -> list[str]:
    """The types docs/architecture.md lists under "One run followed through", in order."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## One run followed through", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `(\w+)`", section, flags=re.M)


def test_the_documented_types_are_those_the_path_meets_in_order() -> None:
    assert documented() == types_met()


def test_at_most_fifteen_types_from_train_to_the_optimizer_step() -> None:
    assert 0 < len(types_met()) <= LIMIT, types_met()
