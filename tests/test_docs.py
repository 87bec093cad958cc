"""docs/tutorial.md and docs/from-the-post.md are runnable: every code block in them is executed,
and shown output is checked.

The rules, so that the tutorial cannot drift from the code without a test failing:

- ```` ```python ```` blocks run, in order, with this Python (the venv's), in one scratch
  directory shared by the whole page (as a reader following along would have).
- ```` ```python file=NAME ```` blocks are written to NAME in that directory instead; a later
  command must run them (checked).
- ```` ```console ```` / ```` ```bash ```` blocks: each line starting with ``$ `` is a command, run
  with ``bash`` in the scratch directory with the venv's ``bin/`` first on PATH (so ``python``,
  ``torchrun`` and ``scaleloop`` are the venv's); a line ending in ``\\`` continues on the next.
  Every command must exit with 0. The lines after a command, up to the next one, are output the
  reader should see.
- ```` ```text ```` blocks are only allowed right after a ``python`` block: they are its output.
- Any other kind of block fails the inventory test: there is no silent, unexecuted block.

Shown output is checked line by line against the real output (stdout and stderr together): each
shown line must match a distinct line of it, in any order (ranks print concurrently). In a
shown line ``...`` matches anything, and a number with a decimal point or an exponent (a loss, a
time, a difference) matches any number, since those differ in the last digits between machines;
whole numbers (steps, ranks, sizes) and all words must be exactly as shown. A line that is just
``...`` stands for lines left out.

The tutorial's scratch directory starts with a copy of examples/, since it is written to be
followed from the repository root; from-the-post.md's starts empty.

Also checked here: the examples the README and the tutorial list are the files in examples/, and
every ``make`` target the README and the docs name is one the Makefile has. The ``scaleloop``
commands of every other page (and the README) run in tests/test_doc_commands.py and
tests/distributed/test_doc_commands_dist.py, found with this module's parsing and checked with its
output matching (tests/doc_commands.py).
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
from procs import child_env, no_process_left, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "tutorial.md"
FROM_THE_POST = ROOT / "docs" / "from-the-post.md"
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
VENV_BIN = Path(sys.executable).parent
COMMAND_TIMEOUT = 180

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*(.*?)\s*$")
SHELL_KINDS = ("console", "bash")


# --- parsing --------------------------------------------------------------------------------
@dataclass
class Block:
    kind: str
    attrs: dict[str, str]
    text: str
    line: int                                    # 1-based line of the opening fence
    commands: list[tuple[str, list[str]]] = field(default_factory=list)   # shell: (command, shown output)

    @property
    def label(self) -> str:
        return f"line {self.line} ({self.kind}{' ' + self.attrs['file'] if 'file' in self.attrs else ''})"


def parse_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, kind, info = m.groups()
        attrs = dict(a.split("=", 1) for a in info.split() if "=" in a)
        body = []
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        block = Block(kind=kind or "(none)", attrs=attrs, text="\n".join(body) + "\n", line=i + 1)
        if block.kind in SHELL_KINDS:
            block.commands = parse_commands(body)
        blocks.append(block)
        i = j + 1
    return blocks


def parse_commands(body: list[str]) -> list[tuple[str, list[str]]]:
    commands: list[tuple[str, list[str]]] = []
    k = 0
    while k < len(body):
        line = body[k]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\") and k + 1 < len(body):
                k += 1
                cmd = cmd[:-1] + " " + body[k].strip()
            commands.append((cmd, []))
        elif commands:
            commands[-1][1].append(line)
        elif line.strip():
            commands.append(("", [line]))          # output before any command: caught by the inventory
        k += 1
    return commands


# --- output checking ------------------------------------------------------------------------
_FLOAT = re.compile(r"-?(?:\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)")
_ANY_NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


# A duration as the summary prints it (output.metrics.format_seconds): a run shown taking "5.9 s"
# may take "1 min 02 s" on a slower or busier machine.
_DURATION = re.compile(r"\d+(?:\.\d+)? s\b|\d+ min \d+ s\b|\d+ h \d+ min\b")
_ANY_DURATION = r"(?:\d+(?:\.\d+)? s|\d+ min \d+ s|\d+ h \d+ min)"


def line_pattern(shown: str) -> re.Pattern:
    parts = []
    for k, segment in enumerate(shown.strip().split("...")):
        if k:
            parts.append(".*")
        pos = 0
        for d in _DURATION.finditer(segment):
            parts.append(_numbers(segment[pos:d.start()]))
            parts.append(_ANY_DURATION)
            pos = d.end()
        parts.append(_numbers(segment[pos:]))
    return re.compile("".join(parts))


def _numbers(segment: str) -> str:
    parts, pos = [], 0
    for m in _FLOAT.finditer(segment):
        parts.append(_literal(segment[pos:m.start()]))
        parts.append(_ANY_NUMBER)
        pos = m.end()
    parts.append(_literal(segment[pos:]))
    return "".join(parts)


def _literal(text: str) -> str:
    return r"\s+".join(re.escape(word) for word in re.split(r"\s+", text)) if text.strip() else (r"\s*" if text else "")


def check_output(shown: list[str], actual: str, where: str) -> None:
    lines = [line.strip() for line in actual.splitlines()]
    used: set[int] = set()
    for expected in shown:
        if not expected.strip() or expected.strip() == "...":
            continue
        pattern = line_pattern(expected)
        hit = next((n for n, line in enumerate(lines) if n not in used and pattern.fullmatch(line)), None)
        assert hit is not None, (f"{where}: the tutorial shows\n    {expected.strip()}\nbut the real output has no "
                                 f"such line. Real output:\n{actual}")
        used.add(hit)


# --- running --------------------------------------------------------------------------------
def reader_env() -> dict[str, str]:
    env = child_env({"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                     "VIRTUAL_ENV": str(VENV_BIN.parent)})
    env.pop("OMP_NUM_THREADS", None)             # as on a reader's machine: torchrun sets it per worker
    return env


# The console scripts a page's commands start with, as the Python command each one runs.
_AS_PYTHON = {"scaleloop": ["-m", "scaleloop"], "torchrun": ["-m", "torch.distributed.run"], "python": [], "python3": []}


def as_python(cmd: str) -> Optional[list[str]]:
    """A shell command that only starts one of :data:`_AS_PYTHON` (no pipes, redirections or
    variables), as this Python's command line: it then runs as a fork of the tests' fork server
    (``tests/distributed/forkserver.py``), which has imported torch once. Else None: bash runs it."""
    if re.search(r"[|&;<>$`()*?\[\]{}~\\'\"]", cmd):
        return None
    words = cmd.split()
    if not words or words[0] not in _AS_PYTHON:   # a command, not VAR=value before one
        return None
    argv = [sys.executable, *_AS_PYTHON[words[0]], *words[1:]]
    return argv if len(argv) > 1 else None


def execute(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``argv`` (its output and standard error together); torchrun's workers end with it."""
    res = run(argv, cwd=cwd, timeout=COMMAND_TIMEOUT, env=reader_env(), merge=True)
    return res.returncode, res.stdout


class Session:
    """Runs a document's blocks in order, once, in one scratch directory."""

    def __init__(self, blocks: list[Block], workdir: Path) -> None:
        self.blocks = blocks
        self.workdir = workdir
        self.done = 0
        self.results: dict[int, tuple[Optional[str], float]] = {}   # index -> (failure or None, seconds)
        self.outputs: dict[int, str] = {}

    def check_block(self, index: int) -> None:
        """Run the blocks up to ``index`` (each once) and fail the test with block ``index``'s failure."""
        self.run_through(index)
        failure, _ = self.results[index]
        if failure is not None:
            pytest.fail(failure, pytrace=False)

    def run_through(self, index: int) -> None:
        while self.done <= index:
            k = self.done
            started = time.perf_counter()
            try:
                self._run(k)
                failure = None
            except AssertionError as exc:
                failure = str(exc)
            self.results[k] = (failure, time.perf_counter() - started)
            self.done += 1

    def _run(self, k: int) -> None:
        block = self.blocks[k]
        if block.kind == "python" and "file" in block.attrs:
            (self.workdir / block.attrs["file"]).write_text(block.text, encoding="utf-8")
        elif block.kind == "python":
            code, out = execute([sys.executable, "-c", block.text], self.workdir)
            self.outputs[k] = out
            assert code == 0, f"python block at {block.label} failed ({code}):\n{out}"
        elif block.kind == "text":
            check_output(block.text.splitlines(), self.outputs.get(k - 1, ""), f"output block at {block.label}")
        elif block.kind in SHELL_KINDS:
            for cmd, shown in block.commands:
                code, out = execute(as_python(cmd) or ["bash", "-c", cmd], self.workdir)
                assert code == 0, f"command at {block.label} failed ({code}):\n$ {cmd}\n{out}"
                check_output(shown, out, f"$ {cmd} (at {block.label})")


def inventory_problems(blocks: list[Block]) -> list[str]:
    problems = []
    later_commands = []
    for k, block in reversed(list(enumerate(blocks))):
        if block.kind == "python" and "file" in block.attrs:
            if not any(block.attrs["file"] in cmd for cmd in later_commands):
                problems.append(f"{block.label}: no later command runs {block.attrs['file']}")
        elif block.kind == "text":
            previous = blocks[k - 1] if k else None
            if previous is None or previous.kind != "python" or "file" in previous.attrs:
                problems.append(f"{block.label}: a text block must directly follow the python block whose output it is")
        elif block.kind in SHELL_KINDS:
            if not block.commands or any(not cmd for cmd, _ in block.commands):
                problems.append(f"{block.label}: every line of a {block.kind} block is a '$ ' command or its output")
            later_commands.extend(cmd for cmd, _ in block.commands)
        elif block.kind != "python":
            problems.append(f"{block.label}: a '{block.kind}' block would not be executed; use python, console, bash "
                            "or (for a python block's output) text")
    return problems


# --- the tests ------------------------------------------------------------------------------
TUTORIAL_BLOCKS = parse_blocks(TUTORIAL)
FROM_THE_POST_BLOCKS = parse_blocks(FROM_THE_POST)


@pytest.mark.parametrize("blocks", [TUTORIAL_BLOCKS, FROM_THE_POST_BLOCKS], ids=["tutorial", "from-the-post"])
def test_doc_blocks_are_all_executed_or_checked(blocks: list[Block]) -> None:
    assert blocks, "the page has no code blocks"
    assert inventory_problems(blocks) == []
    kinds = {b.kind for b in blocks}
    assert {"python", "console"} <= kinds


def test_output_matching_rules() -> None:
    assert line_pattern("step 10: loss 0.6580").fullmatch("step 10: loss 0.6613")
    assert not line_pattern("step 10: loss 0.6580").fullmatch("step 11: loss 0.6580")    # whole numbers exact
    assert not line_pattern("step 10: loss 0.6580").fullmatch("step 10: LOSS 0.6580")    # words exact
    assert line_pattern("largest difference 1.2e-07 of ...").fullmatch("largest difference 3.0e-08 of the largest weight")
    assert line_pattern("a   b").fullmatch("a b")
    shown = line_pattern("wall time        5.9 s (training 2.5 s)")    # durations in any of their forms
    assert shown.fullmatch("wall time 1 min 00 s (training 42.2 s)") and shown.fullmatch("wall time 2 h 01 min (training 7 s)")
    assert not shown.fullmatch("wall time 5.9 s (training 2.5 s, data 1.0 s)")
    assert not line_pattern("30 steps").fullmatch("31 steps")
    with pytest.raises(AssertionError, match="no such line"):
        check_output(["rank 0/2: 30 steps"], "rank 0/1: 30 steps\n", "here")


def test_only_plain_commands_run_as_this_python() -> None:
    assert as_python("scaleloop train --mesh dp=2,tp=2") == [sys.executable, "-m", "scaleloop", "train", "--mesh", "dp=2,tp=2"]
    assert as_python("torchrun --nproc_per_node=2 grads.py") == [sys.executable, "-m", "torch.distributed.run",
                                                                  "--nproc_per_node=2", "grads.py"]
    assert as_python("python examples/00_single.py") == [sys.executable, "examples/00_single.py"]
    for shell in ("OMP_NUM_THREADS=1 python x.py", "scaleloop train; echo $?", "python x.py > out.txt",
                  "for b in 1 2; do scaleloop train; done", "python", "sed 's/a/b/' x.py", "ls"):
        assert as_python(shell) is None, shell


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Session:
    workdir = tmp_path_factory.mktemp("tutorial")
    shutil.copytree(ROOT / "examples", workdir / "examples")
    return Session(TUTORIAL_BLOCKS, workdir)


@pytest.fixture(scope="module")
def from_the_post(tmp_path_factory: pytest.TempPathFactory) -> Session:
    return Session(FROM_THE_POST_BLOCKS, tmp_path_factory.mktemp("from-the-post"))


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    yield
    no_process_left()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(TUTORIAL_BLOCKS)), ids=[b.label.replace(" ", "-") for b in TUTORIAL_BLOCKS])
def test_tutorial_block(tutorial: Session, index: int) -> None:
    tutorial.check_block(index)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("index", range(len(FROM_THE_POST_BLOCKS)),
                         ids=[b.label.replace(" ", "-") for b in FROM_THE_POST_BLOCKS])
def test_from_the_post_block(from_the_post: Session, index: int) -> None:
    from_the_post.check_block(index)


# --- what the pages say about the repository ------------------------------------------------
EXAMPLE_NAME = re.compile(r"\b(\d\d_\w+\.py)\b")


def examples_listed(text: str, opening: str) -> list[str]:
    """The example scripts named, in order, in the paragraph of ``text`` that contains ``opening``."""
    paragraph = next((p for p in re.split(r"\n\s*\n", text) if opening in p), None)
    assert paragraph is not None, f"no paragraph says {opening!r}"
    return list(dict.fromkeys(EXAMPLE_NAME.findall(paragraph)))


def example_files() -> list[str]:
    return sorted(p.name for p in (ROOT / "examples").glob("[0-9][0-9]_*.py"))


def test_examples_listed_finds_a_missing_example() -> None:
    text = "Intro.\n\nThe scripts: `00_a.py` to `01_b.py`, and\n`02_c.py`.\n\nOther `03_d.py`."
    assert examples_listed(text, "The scripts") == ["00_a.py", "01_b.py", "02_c.py"]


@pytest.mark.parametrize("page, opening", [(TUTORIAL, "The scripts are in"), (README, "grows such a loop")],
                         ids=["tutorial", "readme"])
def test_the_examples_list_is_the_examples_directory(page: Path, opening: str) -> None:
    listed = examples_listed(page.read_text(encoding="utf-8"), opening)
    assert listed == example_files(), (f"{page.name} lists the examples {listed}, but examples/ holds "
                                       f"{example_files()}")


def make_targets_named(text: str) -> set[str]:
    return set(re.findall(r"`make ([\w-]+)", text))


def test_every_make_target_the_docs_name_exists() -> None:
    makefile = MAKEFILE.read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    assert make_targets_named("run `make train`, then `make gpu-check GPU_CHECK_FLAGS=--cpu`") == {"train", "gpu-check"}
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = {f"{page.name}: make {t}" for page in pages for t in make_targets_named(page.read_text(encoding="utf-8"))
               if t not in targets}
    assert not missing, f"make targets the docs name but the Makefile lacks: {sorted(missing)}"


def relative_links(text: str) -> list[str]:
    """The targets of a page's markdown links that are files of this repository (no URLs, no anchors)."""
    targets = (m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+)\)", text))
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def test_every_relative_link_of_the_docs_and_results_resolves() -> None:
    assert relative_links("[a](../x.md#y), [b](https://e.org), [c](#here), ![d](d.png)") == ["../x.md", "d.png"]
    pages = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages
              for target in relative_links(page.read_text(encoding="utf-8")) if not (page.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join("  " + b for b in broken)


def test_the_readme_first_screen_starts_a_newcomer() -> None:
    """What scaleloop is, where to start reading, how to install, the two commands: in the first 40 lines."""
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:40])
    for needed in ("docs/from-the-post.md", "docs/tutorial.md", "pip install", "make train", "make test"):
        assert needed in first, f"the README's first 40 lines do not mention {needed}"
    assert "Tested versions" not in first, "the tested versions belong further down the README"


@pytest.mark.slow
def test_readme_library_example_runs(tmp_path: Path) -> None:
    blocks = [b for b in parse_blocks(README) if b.kind == "python"]
    assert blocks, "README.md shows no library example"
    for block in blocks:
        code, out = execute([sys.executable, "-c", block.text], tmp_path)
        assert code == 0, f"README python block at {block.label} failed ({code}):\n{out}"
