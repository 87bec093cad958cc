"""The package's layout stays legible: no import cycles, and every package says what is in it.

Both tests read the source with ``ast`` and import nothing, so they take no time and hold
whether or not torch is installed.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "scaleloop"


def module_name(path: Path) -> str:
    """``src/scaleloop/loop/training.py`` -> ``scaleloop.loop.training``; an ``__init__`` is its package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> Optional[str]:
    """The module an ``ImportFrom`` names, relative imports resolved against ``name``."""
    if not node.level:
        return node.module
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of the package that ``path`` imports, at module level or inside functions.

    ``import a.b`` imports ``a.b``; ``from a import b`` imports ``a.b`` when ``b`` is a submodule,
    else ``a``. A package counts as the module its ``__init__`` is.
    """
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, name, is_package)
            if not target:
                continue
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = [_one_cycle(graph, set(c)) for c in components]
    # A tangle of more modules than its shortest cycle: name them all.
    return [cycle + ([f"(tangled: {', '.join(c)})"] if len(c) > len(cycle) - 1 else [])
            for cycle, c in zip(cycles, components)]


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, as a path that ends where it starts."""
    start = min(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & component):
            if w == start:
                return paths[v] + [start]
            if w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")   # pragma: no cover


def test_the_import_graph_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in cycles)


def packages() -> Iterator[Path]:
    yield from sorted(p.parent for p in (ROOT / PACKAGE).rglob("__init__.py"))


def test_every_package_docstring_maps_its_modules() -> None:
    missing = []
    for package in packages():
        tree = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree) or ""
        named = set(re.findall(r"``([\w.]+)``", doc))
        members = [p.stem for p in package.glob("*.py") if p.name != "__init__.py"]
        members += [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
        absent = sorted(m for m in members if m not in named)
        if absent:
            missing.append(f"{module_name(package / '__init__.py')}: {', '.join(absent)}")
    assert not missing, "package docstrings that do not name (in ``double backticks``) these modules:\n" + \
        "\n".join("  " + m for m in missing)


# The floors of the house, bottom first (docs/architecture.md). A part (a subpackage, or a top-level
# module) may import parts on its own floor or below, never above; two parts never import each
# other. Left out: the package root (a facade of lazy re-exports) and ``__main__`` modules (entry
# points: run, never imported, so they stand on the top floor whatever package holds them).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "plugins", "option"),  # one-line errors; user code named as pkg.module:attr; a setting's declaration
    ("runtime",),                    # ground: this process (DistEnv, devices, collectives, mesh, signals)
    ("data", "models", "hfconfig", "output"),   # what is trained on, what is trained (built-in, or a
                                                # transformers config), what a run writes
    ("checkpoint",),                 # store, state, resume, replicas; the Checkpointer
    ("strategies",),                 # parallelism: how the model, optimizer and loader are wrapped
    ("config",),                     # the flat settings, handed out in sections that their owners check
    ("loop",),                       # the trainer: build a run, step, evaluate, finish
    ("ray",),                        # Ray Train as a home: train in its workers, report to it
    ("launching",),                  # starting workers: torchrun, the worker entry, launch(), failures
    ("verify", "bench", "plan", "sampling"),   # the tools built on training and launching; text from a trained model
    ("commands", "cli"),             # one module per subcommand; cli parses and dispatches
)


def part_of(module: str) -> Optional[str]:
    """``scaleloop.loop.training`` -> ``loop``; None for the package root and ``__main__`` modules."""
    bits = module.split(".")
    if len(bits) == 1 or bits[-1] == "__main__":
        return None
    return bits[1]


def layer_breaches(graph: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """Imports that go up a floor (``module -> module``), and parts that import each other."""
    floor = {part: i for i, parts in enumerate(LAYERS) for part in parts}
    upward, edges = [], set()
    for module, targets in graph.items():
        mine = part_of(module)
        if mine is None:
            continue
        for target in targets:
            theirs = part_of(target)
            if theirs is None or theirs == mine:
                continue
            edges.add((mine, theirs))
            if floor[theirs] > floor[mine]:
                upward.append(f"{module} -> {target}")
    mutual = sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)
    return sorted(upward), mutual


def test_every_part_has_a_floor() -> None:
    parts = {part_of(m) for m in all_modules()} - {None}
    floors = {p for parts in LAYERS for p in parts}
    assert parts == floors, f"parts without a floor: {sorted(parts - floors)}; floors without a part: {sorted(floors - parts)}"


def test_the_layer_check_finds_a_planted_breach() -> None:
    graph = {"scaleloop.data.loader": {"scaleloop.loop.step"}, "scaleloop.loop.step": {"scaleloop.data.loader"},
             "scaleloop.bench.__main__": {"scaleloop.cli"}, "scaleloop.cli": {"scaleloop.commands.bench"}}
    upward, mutual = layer_breaches(graph)
    assert upward == ["scaleloop.data.loader -> scaleloop.loop.step"]
    assert mutual == ["data <-> loop"]


def test_no_import_goes_up_a_floor_and_no_two_parts_import_each_other() -> None:
    upward, mutual = layer_breaches(import_graph())
    assert not upward, "imports that go up a floor (docs/architecture.md):\n" + "\n".join("  " + u for u in upward)
    assert not mutual, "parts that import each other:\n" + "\n".join("  " + m for m in mutual)


def readme_layout() -> dict[str, str]:
    """The README's Layout block: each entry (``src/scaleloop/``, ``  loop/``, ``tools/``) -> its text."""
    text = (ROOT.parent / "README.md").read_text(encoding="utf-8")
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        head = line[:19].strip()
        if head:
            current = head
            entries[current] = ""
        if current is not None:
            entries[current] += " " + line[19:]
    return entries


def test_the_readme_layout_names_every_module() -> None:
    entries = readme_layout()
    missing = []
    for package in packages():
        key = "src/scaleloop/" if package.name == PACKAGE else f"{package.name}/"
        words = set(re.findall(r"[\w]+", entries.get(key, "")))
        for module in sorted(p.stem for p in package.glob("*.py") if p.name != "__init__.py" or key == "src/scaleloop/"):
            if module not in words:
                missing.append(f"{key}{module}")
    tools = set(re.findall(r"[\w]+", entries.get("tools/", "")))
    tools_dir = ROOT.parent / "tools"
    names = {p.relative_to(tools_dir).with_suffix("").as_posix(): p.stem for p in tools_dir.rglob("*.py")
             if p.name != "__init__.py"}
    names.update({p.parent.relative_to(tools_dir).as_posix(): p.parent.name for p in tools_dir.rglob("__init__.py")})
    missing += [f"tools/{path}" for path, name in sorted(names.items()) if name not in tools]
    assert not missing, "modules the README's Layout does not name: " + ", ".join(missing)


def test_the_readme_lists_every_doc() -> None:
    text = (ROOT.parent / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^- \[docs/([\w.-]+\.md)\]", text.split("## Documentation", 1)[1], re.M))
    docs = {p.name for p in (ROOT.parent / "docs").glob("*.md")}
    assert not docs - listed, f"docs the README's Documentation list leaves out: {sorted(docs - listed)}"


def private_imports() -> list[str]:
    """``from scaleloop.<part>... import _name`` in a module of another part: a private name
    reached across a package's wall."""
    found = []
    for name, path in all_modules().items():
        mine = part_of(name) or name
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
                theirs = part_of(node.module) or node.module
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and theirs != mine]
    return found


def test_no_part_imports_another_parts_private_names() -> None:
    found = private_imports()
    assert not found, "private names imported from another part:\n" + "\n".join("  " + f for f in found)
