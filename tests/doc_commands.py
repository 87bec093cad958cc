"""The ``scaleloop`` commands that README.md and docs/*.md show, found in the pages, and how the
tests run each one (tests/test_doc_commands.py, tests/distributed/test_doc_commands_dist.py).

docs/tutorial.md and docs/from-the-post.md are run block by block by tests/test_docs.py; this
module covers every other page. A command is found:

- in a shell block (``bash``, ``console``, or one with no language): a ``$ `` line, or in a
  ``bash`` block or a block without prompts, a line that starts one; ``\\`` continues a line, a
  ``#`` comment is dropped. ``VAR=value`` before it is its environment; ``srun`` and
  ``python -m scaleloop`` and ``python -m torch.distributed.run ... -m scaleloop`` start it too.
  Indented lines and ``text`` blocks are output, not commands;
- in a Kubernetes manifest (``yaml``): each container's ``command`` and ``args``;
- in a Python block: ``scaleloop.cli.main([...])`` and ``TrainConfig(...)`` (docs/ray.md).

Every command runs as the page has it, made small: ``--max-steps`` is added (one step more for
each command that continues the same ``--out``), ``--n-samples 64`` where the data is made up
(random, images, tokens) and the command names no size, ``--seq-len 16`` for made-up tokens
without one, and ``verify`` takes ``--steps 1``. What else differs for a command is in
:data:`HOW`, with the reason: a command for GPUs runs with ``--device cpu``, a cluster's
addresses and ports become this machine's (free ports, so that tests running side by side do
not collide), and the absolute paths of a cluster's volumes (``/runs``, ``/data``, ``/shared``,
``$HOME``) lie in the page's scratch directory. One-process commands run in this process
through ``scaleloop.cli.main`` (fast); those of several processes as forks of the tests' fork
server, and the machines of one job (pods, SLURM tasks, ``--nnodes`` launchers) all at once
(``distributed/forkgroup.py``), each with the environment its job would give it.
"""
from __future__ import annotations

import ast
import contextlib
import gzip
import io
import json
import os
import re
import shlex
import shutil
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _folder in (HERE / "distributed", HERE / "runtime", HERE):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from test_docs import Block, check_output, parse_blocks, parse_commands  # noqa: E402

#: The pages whose commands are found here (test_docs.py runs the other two block by block).
RUN_BY_TEST_DOCS = ("tutorial.md", "from-the-post.md", "language-models.md")
PAGES = [ROOT / "README.md", *(p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in RUN_BY_TEST_DOCS)]
SUBCOMMANDS = ("train", "tune-batch", "plan", "verify", "bench", "doctor", "plot", "env")
MADE_UP_DATA = ("random", "images", "tokens")
#: A cluster's volumes, and where they lie in a page's scratch directory.
VOLUMES = {"/runs/": "volume/runs/", "/data/": "volume/data/", "/shared/": "volume/shared/"}
COMMAND_TIMEOUT = 240
#: How many commands that share nothing run at the same time (PageRun.run_all).
AT_ONCE = 2


# --- finding the commands -------------------------------------------------------------------
@dataclass(frozen=True)
class DocCommand:
    """One command of a page, as written (continuations joined, comment dropped)."""

    page: str                        # "README.md", "docs/kubernetes.md"
    line: int                        # its first line in the page
    text: str
    source: str = "shell"            # "shell", "script" (a batch script), "manifest", "python"
    block: str = ""                  # the whole block of a script, a manifest or a Python block

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Invocation:
    """What a command line starts: ``scaleloop ARGV`` with ``env`` before it, maybe under srun
    or torchrun (its arguments before ``-m scaleloop``)."""

    env: dict
    argv: list
    srun: bool = False
    torchrun: Optional[list] = None


def invocation(words: list[str]) -> Optional[Invocation]:
    """The scaleloop command ``words`` start, or None (another program)."""
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    srun = bool(words) and words[0] == "srun"
    if srun:
        words = words[1:]
    torchrun = None
    if words[:1] == ["scaleloop"]:
        argv = words[1:]
    elif words[:1] in (["python"], ["python3"]) and words[1:3] == ["-m", "scaleloop"]:
        argv = words[3:]
    elif words[:1] == ["torchrun"] or (words[:1] in (["python"], ["python3"])
                                       and words[1:3] == ["-m", "torch.distributed.run"]):
        rest = words[1:] if words[0] == "torchrun" else words[3:]
        at = next((k for k in range(len(rest) - 1) if rest[k:k + 2] == ["-m", "scaleloop"]), None)
        if at is None:
            return None
        torchrun, argv = rest[:at], rest[at + 2:]
    else:
        return None
    if not argv or argv[0] not in SUBCOMMANDS:
        return None
    return Invocation(env, argv, srun, torchrun)


def words_of(text: str) -> Optional[list[str]]:
    try:
        return shlex.split(text, comments=True)
    except ValueError:            # not shell (unbalanced quotes in prose-like lines)
        return None


def _joined(lines: list[str], start: int) -> list[tuple[int, str]]:
    """``lines`` with ``\\`` continuations joined: (offset of the first line, line)."""
    out: list[tuple[int, str]] = []
    k = 0
    while k < len(lines):
        first, text = k, lines[k]
        while text.rstrip().endswith("\\") and k + 1 < len(lines):
            k += 1
            text = text.rstrip()[:-1] + " " + lines[k].strip()
        out.append((start + first, text))
        k += 1
    return out


def _shell_commands(page: str, block: Block) -> list[DocCommand]:
    lines = block.text.splitlines()
    source = "script" if lines[:1] == ["#!/bin/bash"] else "shell"
    if block.kind == "console" or any(line.startswith("$ ") for line in lines):
        found = [(block.line + 1, cmd) for cmd, _ in parse_commands(lines) if cmd]
    else:   # every unindented line is a command; indented ones are its output or continuations
        found = [(n, t) for n, t in _joined(lines, block.line + 1) if t and not t[0].isspace()]
    commands = []
    for line, text in found:
        words = words_of(text)
        if words and invocation(words) is not None:
            clean = text.split(" #")[0].strip() if "#" in text else text.strip()
            commands.append(DocCommand(page, line, re.sub(r"\s+", " ", clean), source,
                                       block.text if source == "script" else ""))
    return commands


def _manifest_commands(page: str, block: Block) -> list[DocCommand]:
    doc = yaml.safe_load(block.text)
    spec = doc.get("spec", {}) if isinstance(doc, dict) else {}
    containers = [spec["trainer"]] if "trainer" in spec else [
        c for replica in spec.get("pytorchReplicaSpecs", {}).values() for c in replica["template"]["spec"]["containers"]]
    found: list[DocCommand] = []
    for container in containers:
        words = [str(w) for w in container.get("command", []) + container.get("args", [])]
        if words and invocation(words) is not None:
            found.append(DocCommand(page, block.line, shlex.join(words), "manifest", block.text))
    # Every pod of a job runs the same command (tests/runtime/test_kubeflow.py checks it): one run of the job.
    return list(dict.fromkeys(found))


def _python_commands(page: str, block: Block) -> list[DocCommand]:
    found = []
    try:
        tree = ast.parse(block.text)
    except SyntaxError:   # a fragment ("..." for the rest): it must not hide a command
        assert "scaleloop.cli.main" not in block.text and "TrainConfig(" not in block.text, \
            f"{page}:{block.line}: a Python block that does not parse holds a scaleloop command"
        return []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name == "scaleloop.cli.main" and node.args and isinstance(node.args[0], ast.List):
            argv = [ast.literal_eval(e) for e in node.args[0].elts]
            found.append(DocCommand(page, block.line + node.lineno, shlex.join(["scaleloop", *argv]), "python", block.text))
        elif name == "TrainConfig":
            found.append(DocCommand(page, block.line + node.lineno, ast.unparse(node), "python", block.text))
    return found


def commands_of(page: Path) -> list[DocCommand]:
    """Every scaleloop command ``page`` shows, in the page's order."""
    name = str(page.relative_to(ROOT))
    found: list[DocCommand] = []
    for block in parse_blocks(page):
        if block.kind in ("bash", "sh", "console", "(none)"):
            found += _shell_commands(name, block)
        elif block.kind == "yaml":
            found += _manifest_commands(name, block)
        elif block.kind == "python":
            found += _python_commands(name, block)
    return found


def config_flags(call: str) -> list[str]:
    """``TrainConfig(k=v, ...)`` as ``scaleloop train`` flags."""
    node = ast.parse(call, mode="eval").body
    assert isinstance(node, ast.Call)
    return [f"--{kw.arg.replace('_', '-')}={ast.literal_eval(kw.value)}" for kw in node.keywords if kw.arg]


# --- how each runs --------------------------------------------------------------------------
@dataclass(frozen=True)
class How:
    """What a command needs besides making it small: picked by its page and a piece of its text."""

    page: str
    match: str                       # in the command's text, or in a manifest or script's whole block
    source: str = ""                 # only commands from this kind of place ("shell", "manifest", ...)
    why: str = ""                    # what differs from the page, and why
    skip: bool = False               # not run here: ``why`` says what runs it instead
    same_as: str = ""                # a skipped command equal to another of the page (checked)
    expect: int = 0                  # exit code (each machine's, for several)
    shows: tuple = ()                # lines the output must have (matched as test_docs matches them)
    env: tuple = ()                  # (name, value) pairs
    flags: tuple = ()                # added after the command's own (the later flag wins)
    replace: tuple = ()              # (old, new) word substitutions; "{port}" is a free port
    steps: bool = True               # add --max-steps (not for a run that must reach its failure)
    here: bool = False               # in this process although it names --nproc: it stops before starting any
    run_as: str = ""                 # "pods", "srun", "ray"
    machines: int = 0                # the same command on this many machines at once
    together: str = ""               # the commands of one job, run at the same time
    files: tuple = ()                # what it needs in the scratch directory


GPU = "the page runs it on GPUs: here --device cpu"
HOW: tuple[How, ...] = (
    How("docs/checkpointing.md", "--epochs 50 --checkpoint-every 20 --out runs/long",
        why="the page stops it with Ctrl-C; here --max-steps stops it"),
    How("docs/data-parallelism.md", "--nproc-per-node=N", skip=True,
        why="the command scaleloop's launcher runs (N and <run> are placeholders): every --nproc run here runs it"),
    How("docs/kubernetes.md", "scaleloop train --strategy ddp", source="shell", skip=True, same_as="name: digits-ddp",
        why="the command of every pod: the pods of the manifests that name it run it"),
    How("docs/kubernetes.md", "RANK=1 WORLD_SIZE=2 scaleloop train", expect=2,
        shows=("scaleloop: error: RANK=1, WORLD_SIZE=2 are set, but no torchrun, srun or Kubeflow job started this "
               "process (left from an earlier job or a notebook?): run `unset RANK WORLD_SIZE` first, or give "
               "--nproc N to start N workers here",)),
    How("docs/kubernetes.md", "  nprocPerNode:", source="manifest", run_as="pods", flags=("--device", "cpu"),
        why="its 2 pods of 2 processes as the operator starts them (" + GPU + ")"),
    How("docs/kubernetes.md", "kind: TrainJob", source="manifest", run_as="pods", flags=("--device", "cpu"),
        why="its 2 pods as Trainer starts them (" + GPU + ": auto is 1 process a pod here)"),
    How("docs/kubernetes.md", "elasticPolicy", source="manifest", run_as="pods", flags=("--device", "cpu"),
        why="its 3 pods as the operator starts them (" + GPU + ")"),
    How("docs/fault-tolerance.md", "--replica-group 0 --lighthouse lh:29510", skip=True,
        why="a group of the several-machine form, beside a lighthouse (not a scaleloop command) on host lh: "
            "tests/distributed/test_fault_tolerance.py starts the lighthouse and both groups this way on one machine"),
    How("docs/fault-tolerance.md", "--replica-group 1 --lighthouse lh:29510", skip=True,
        why="a group of the several-machine form, beside a lighthouse (not a scaleloop command) on host lh: "
            "tests/distributed/test_fault_tolerance.py starts the lighthouse and both groups this way on one machine"),
    How("docs/models-and-data.md", "--data-dir data/shakespeare", replace=(("data/shakespeare", "tokens"),),
        flags=("--batch-size", "4"), files=("tokens",),
        why="a token file made here; --batch-size 4, as 64 windows of 256 over 50,304 classes take GBs"),
    How("docs/models-and-data.md", "--data-dir DIR", replace=(("DIR", "tokens"),), files=("tokens",),
        why="DIR: a token file made here"),
    How("docs/multinode.md", "--node-rank 0 --nproc 1 --master-addr 127.0.0.1", together="static",
        replace=(("29531", "{port}"),), why="both machines at once, on a free port"),
    How("docs/multinode.md", "--node-rank 1 --nproc 1 --master-addr 127.0.0.1", together="static",
        replace=(("29531", "{port}"),), why="both machines at once, on a free port"),
    How("docs/multinode.md", "--rdzv-endpoint 127.0.0.1:29400", machines=2, replace=(("29400", "{port}"),),
        why="the same command on 2 machines at once, sharing --out as on a shared file system, on a free port"),
    How("docs/multinode.md", "--nnodes 2:3", machines=3,
        replace=(("10.0.0.3:29400", "127.0.0.1:{port}"), ("--nproc 8", "--nproc 1"),
                 ("last_call_timeout=5", "last_call_timeout=60")),
        why="3 machines here, 1 process each, not 8 (2 CPU cores here); the round waits up to 60 s, not 5, "
            "for the third machine (it closes as that one joins): a loaded test machine can start it more than "
            "5 s after the second, which then trained without it and was gone when it came"),
    How("docs/planning.md", "scaleloop plan --gpus 8", replace=(("--n-layers 32", "--n-layers 4"),),
        why="4 layers, not 32: the plan traces the model once a layout, and 32 layers take many seconds"),
    How("docs/ray.md", "scaleloop train --strategy ddp", run_as="ray",
        why="the train function's call, in a group of 2 that torchrun makes instead of Ray's "
            "(Ray itself: tests/distributed/test_ray.py; a Ray job takes about a minute to start on 2 cores)"),
    How("docs/ray.md", "TrainConfig(strategy='fsdp'", run_as="ray",
        why="the train function's config, in a group of 2 that torchrun makes instead of Ray's "
            "(scaleloop.ray.train itself: tests/distributed/test_ray.py)"),
    How("docs/slurm.md", "srun python -m scaleloop train", run_as="srun", flags=("--device", "cpu"), files=("mnist",),
        why="2 tasks (one a node) as srun starts them, not 8: 2 CPU cores here (" + GPU + ")"),
    How("docs/slurm.md", "srun python -m torch.distributed.run", run_as="srun", flags=("--device", "cpu"),
        files=("mnist",), replace=(("--nproc-per-node=4", "--nproc-per-node=1"),),
        why="torchrun on 2 nodes as srun starts it, 1 process a node, not 4 (" + GPU + ")"),
    How("docs/strategies.md", "--nproc 8 --precision bf16", replace=(("--nproc 8", "--nproc 2"),),
        flags=("--device", "cpu"), why="8 GPUs on the page: 2 CPU processes here"),
    How("docs/streaming.md", "--data mypkg.stream:build", files=("mypkg",),
        why="the page's mypkg/stream.py, with the files and reader it leaves to the reader made up"),
    How("docs/tracking.md", "WANDB_MODE=offline scaleloop train --tracker wandb"),   # as it is (not the entry below)
    How("docs/tracking.md", "scaleloop train --tracker wandb", env=(("WANDB_MODE", "offline"),),
        why="the page logs in to wandb first; here offline"),
    How("docs/tracking.md", "MLFLOW_TRACKING_URI=http://mlflow.internal:5000",
        env=(("MLFLOW_TRACKING_URI", "file:./mlflow-server"),), why="the page's server, a local store here"),
    How("docs/troubleshooting.md", "mymodel:raises", expect=1, steps=False, files=("mymodel",),
        shows=("scaleloop: error: rank 1 of 2 failed at epoch 1, step 3: ValueError: bad batch on rank 1",),
        why="its mymodel.py is tests/distributed/scripts/failing_models.py"),
    How("docs/troubleshooting.md", "mymodel:wrong_width", expect=1, steps=False, files=("mymodel",),
        shows=("scaleloop: error: the run failed at epoch 1, step 1: RuntimeError: mat1 and mat2 shapes cannot be "
               "multiplied (64x64 and 32x10)",),
        why="its mymodel.py is tests/distributed/scripts/failing_models.py"),
    How("docs/troubleshooting.md", "mymodel:stalls", expect=1, steps=False, files=("mymodel",),
        replace=(("--timeout 10", "--timeout 5"),),
        shows=("scaleloop: error: the run stalled at epoch 1, step 3: rank 1 stopped taking part; rank 0 gave up "
               "waiting after 5 s (--timeout)",),
        why="its mymodel.py is tests/distributed/scripts/failing_models.py; --timeout 5, not 10, to wait less"),
    How("docs/troubleshooting.md", "--nproc 3 --batch-size 64", expect=2, here=True,
        why="refused before any worker starts: run in this process",
        shows=("scaleloop: error: --batch-size 64 does not split into 3 worker(s) x 1 accumulation step(s) = 3 equal "
               "micro-batches; use a multiple of 3, such as 63 or 66",)),
    How("docs/verification.md", "scaleloop verify --model ... --data ...", skip=True,
        why="the synopsis of verify's flags, not a command"),
    How("docs/verification.md", "--loss userloss:masked_mean", expect=1, files=("userloss",),
        shows=("verify: FAIL (equivalence FAILED)",), why="the page's run fails (the loss's normalisation)"),
    How("docs/verification.md", "--model convnet --batch-size 32 --steps 3", expect=1,
        shows=("verify: FAIL (equivalence FAILED)",), why="the page's run fails (BatchNorm without SyncBatchNorm)"),
)


def how_of(command: DocCommand) -> How:
    """The entry of :data:`HOW` for ``command`` (a plain one when none is needed)."""
    for how in HOW:   # the first that matches (a more particular entry comes before a more general one)
        if how.page == command.page and how.source in ("", command.source) and (
                how.match in command.text or (command.source in ("manifest", "script") and how.match in command.block)):
            return how
    return How(command.page, command.text)


# --- what it needs --------------------------------------------------------------------------
def write_mnist(folder: Path, n_train: int = 600, n_test: int = 100, seed: int = 0) -> None:
    """The four MNIST IDX files (gzipped), with made-up pixels: what ``--data mnist`` reads."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(struct.pack(">II", 0x801, n) + labels.tobytes())


def write_tokens(folder: Path, n_train: int = 20_000, n_val: int = 600, vocab: int = 256, seed: int = 0) -> None:
    """``train.bin`` and ``val.bin`` of uint16 tokens: what ``--data tokenfile`` reads."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    rng.integers(0, vocab, n_train, dtype=np.uint16).tofile(folder / "train.bin")
    rng.integers(0, vocab, n_val, dtype=np.uint16).tofile(folder / "val.bin")


def _python_file(page: str, first_line: str) -> str:
    """The Python block of ``page`` whose first line is ``first_line`` (``# userloss.py``)."""
    for block in parse_blocks(ROOT / page):
        if block.text.startswith(first_line):
            return block.text
    raise AssertionError(f"{page} has no block starting {first_line!r}")


# What the page leaves to the reader in mypkg/stream.py: some files, and a reader of one.
_STREAM_PRELUDE = '''\
import torch as _torch

train_files, test_files = [0, 1, 2, 3], [4]


def read_samples(number):
    g = _torch.Generator().manual_seed(number)
    for _ in range(32):
        x = _torch.randn(784, generator=g)
        yield x, int(x[:10].argmax())
'''


def prepare(where: Path, needs: tuple) -> None:
    """Put what commands need (``How.files``) in a page's scratch directory."""
    for need in needs:
        if need == "mnist":
            for folder in (where / "volume" / "data" / "mnist", where / "home" / "mnist"):
                if not folder.exists():
                    write_mnist(folder)
        elif need == "tokens" and not (where / "tokens").exists():
            write_tokens(where / "tokens")
        elif need == "mymodel":
            shutil.copy(HERE / "distributed" / "scripts" / "failing_models.py", where / "mymodel.py")
        elif need == "userloss":
            (where / "userloss.py").write_text(_python_file("docs/verification.md", "# userloss.py"), encoding="utf-8")
        elif need == "mypkg":
            (where / "mypkg").mkdir(exist_ok=True)
            block = next(b.text for b in parse_blocks(ROOT / "docs" / "streaming.md") if b.text.startswith("# mypkg/stream.py"))
            (where / "mypkg" / "stream.py").write_text(_STREAM_PRELUDE + block, encoding="utf-8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- making a command small -----------------------------------------------------------------
def option(argv: list[str], name: str) -> Optional[str]:
    """The value of ``--name`` in ``argv`` (the last one given; ``--name=value`` too)."""
    value = None
    for k, word in enumerate(argv):
        if word == name and k + 1 < len(argv):
            value = argv[k + 1]
        elif word.startswith(name + "="):
            value = word.split("=", 1)[1]
    return value


def in_volume(word: str, where: Path) -> str:
    """``word`` (a path, or ``--flag=path``) with a cluster's volume replaced by its scratch folder."""
    flag, equals, value = word.rpartition("=") if word.startswith("--") and "=" in word else ("", "", word)
    for mount, folder in VOLUMES.items():
        if value.startswith(mount):
            return flag + equals + str(where / folder / value[len(mount):])
    return word


def small(argv: list[str], how: How, where: Path, steps: int) -> list[str]:
    """``argv`` made small (the module's doc says how), with ``how``'s flags."""
    argv = [in_volume(w, where) for w in argv]
    extra: list[str] = []
    data = option(argv, "--data") or "digits"
    if argv[0] in ("train", "verify") and data in MADE_UP_DATA and option(argv, "--n-samples") is None:
        extra += ["--n-samples", "64" if argv[0] == "train" else "128"]
    if argv[0] in ("train", "verify") and data == "tokens" and option(argv, "--seq-len") is None:
        extra += ["--seq-len", "16"]
    if argv[0] == "train" and how.steps:
        extra += ["--max-steps", str(steps)]
    if argv[0] == "verify":
        extra += ["--steps", "1"]
    return [*argv, *extra, *how.flags]


def substituted(text: str, how: How, port: int) -> str:
    for old, new in how.replace:
        text = text.replace(old, new.replace("{port}", str(port)))
    return text


# --- running --------------------------------------------------------------------------------
@dataclass
class Ran:
    """One machine's run of a command: its exit code and output (standard error included)."""

    code: int
    output: str
    argv: list = field(default_factory=list)


@contextlib.contextmanager
def environment(changes: dict[str, str], drop: tuple = ()) -> Iterator[None]:
    saved = dict(os.environ)
    for name in drop:
        os.environ.pop(name, None)
    os.environ.update(changes)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


#: Variables of a launcher or job that must not reach a command from the tests' own environment.
JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "GROUP_RANK", "KUBERNETES_SERVICE_HOST")


def run_here(argv: list[str], env: dict[str, str], cwd: Path) -> Ran:
    """``scaleloop ARGV`` in this process (``scaleloop.cli.main``), in ``cwd``."""
    import scaleloop.cli

    out = io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with environment(env, drop=JOB_VARIABLES), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = scaleloop.cli.main(argv)
    finally:
        os.chdir(previous)
    return Ran(code, out.getvalue(), argv)


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    from procs import child_env

    env = {k: v for k, v in child_env().items() if k not in JOB_VARIABLES
           and not k.startswith(("PET_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def run_forked(argv: list[str], env: dict[str, str], cwd: Path, timeout: float = COMMAND_TIMEOUT) -> Ran:
    """``python -m scaleloop ARGV`` as a fork of the tests' fork server."""
    from procs import run

    res = run([sys.executable, "-m", "scaleloop", *argv], cwd=cwd, timeout=timeout, env=_clean_env(env), merge=True)
    return Ran(res.returncode, res.stdout, argv)


def run_together(machines: list[tuple[list[str], dict[str, str], Path]], scratch: Path,
                 timeout: float = COMMAND_TIMEOUT, stagger: float = 1.0) -> list[Ran]:
    """Each ``(command line, environment, working directory)`` at the same time (the machines of
    one job), each started ``stagger`` seconds after the one before it; their runs."""
    from procs import run

    scratch.mkdir(parents=True, exist_ok=True)
    tag = f"group-{time.monotonic_ns()}"
    runs = []
    for k, (argv, env, cwd) in enumerate(machines):
        cwd.mkdir(parents=True, exist_ok=True)
        out = scratch / f"{tag}-{k}.out"
        runs.append({"argv": argv, "env": _clean_env(env), "cwd": str(cwd), "stdout": str(out), "stderr": str(out),
                     "delay": k * stagger})
    spec = scratch / f"{tag}.json"
    codes = scratch / f"{tag}-codes.json"
    spec.write_text(json.dumps({"runs": runs, "codes": str(codes)}), encoding="utf-8")
    res = run([sys.executable, str(HERE / "distributed" / "forkgroup.py"), str(spec)], cwd=scratch, timeout=timeout,
              env=_clean_env({}), merge=True)
    assert res.returncode == 0 and codes.exists(), f"the group did not run ({res.returncode}):\n{res.stdout}"
    return [Ran(code, Path(r["stdout"]).read_text(encoding="utf-8", errors="replace"), r["argv"])
            for code, r in zip(json.loads(codes.read_text()), runs)]


def scaleloop_argv(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "scaleloop", *argv]


# --- a page's commands, in order ------------------------------------------------------------
def is_multiprocess(command: DocCommand, how: How) -> bool:
    """Whether ``command`` starts several processes (it then runs forked, not in this process)."""
    if how.skip or how.here:
        return False
    if how.run_as or how.machines or how.together:
        return True
    words = words_of(substituted(command.text, how, 0)) or []
    call = invocation(words)
    if call is None:
        return False
    nproc = option(call.argv, "--nproc")
    return call.argv[0] == "verify" or (nproc is not None and nproc.isdigit() and int(nproc) > 1)


class PageRun:
    """Runs one page's commands in order in one scratch directory (as a reader following the page
    would), each once; later commands see what earlier ones wrote (a run they continue)."""

    def __init__(self, page: str, where: Path) -> None:
        self.page = page
        self.where = where
        where.mkdir(parents=True, exist_ok=True)
        self.commands = commands_of(ROOT / page)
        self.outs: dict[str, int] = {}          # --out -> runs so far
        self.results: dict[int, list[Ran]] = {}

    def steps_for(self, argv: list[str]) -> int:
        out = option(argv, "--out")
        if out is None:
            return 1
        self.outs[out] = self.outs.get(out, 0) + 1
        return self.outs[out]

    def run_all(self) -> None:
        k = 0
        while k < len(self.commands):
            batch = [k]
            while (len(batch) < AT_ONCE and batch[-1] + 1 < len(self.commands) and self._alone(batch[0])
                   and self._alone(batch[-1] + 1)):
                batch.append(batch[-1] + 1)
            if len(batch) > 1:
                self._at_once(batch)
            elif k not in self.results:
                self.run(k)
            k = batch[-1] + 1

    def _alone(self, k: int) -> bool:
        """Whether command ``k`` may run beside its neighbours: several processes of its own, and
        nothing it shares with them (no --out: each runs in a folder of its own; no files)."""
        command = self.commands[k]
        how = how_of(command)
        call = invocation(words_of(substituted(command.text, how, 0)) or [])
        return (k not in self.results and call is not None and is_multiprocess(command, how) and not how.files
                and not (how.run_as or how.machines or how.together) and option(call.argv, "--out") is None)

    def _at_once(self, batch: list[int]) -> None:
        """Commands that share nothing, at the same time: a short run of several processes mostly
        waits (processes starting, meeting, ending), so two at once take little more than one."""
        machines = []
        for k in batch:
            command, how = self.commands[k], how_of(self.commands[k])
            call = invocation(words_of(substituted(command.text, how, 0)) or [])
            assert call is not None
            machines.append((scaleloop_argv(small(call.argv, how, self.where, 1)), {**call.env, **dict(how.env)},
                             self.where / f"command-{k}"))
        for k, ran in zip(batch, run_together(machines, self.where / "groups", stagger=0)):
            self.results[k] = [ran]

    def run(self, k: int) -> list[Ran]:
        command = self.commands[k]
        how = how_of(command)
        if how.skip:
            self.results[k] = []
            return []
        prepare(self.where, how.files)
        if how.run_as == "pods":
            ran = self._pods(command, how)
        elif how.run_as == "srun":
            ran = self._srun(command, how)
        elif how.run_as == "ray":
            ran = self._ray(command, how)
        elif how.together or how.machines:
            ran = self._machines(k, command, how)
        else:
            call = invocation(words_of(substituted(command.text, how, 0)) or [])
            assert call is not None, command
            argv = small(call.argv, how, self.where, self.steps_for(call.argv))
            env = {**call.env, **dict(how.env)}
            ran = [run_forked(argv, env, self.where) if is_multiprocess(command, how) else run_here(argv, env, self.where)]
        self.results[k] = ran
        return ran

    def _ray(self, command: DocCommand, how: How) -> list[Ran]:
        call = invocation(words_of(command.text) or [])
        argv = call.argv if call is not None else ["train", *config_flags(command.text)]
        workers = re.search(r"ScalingConfig\(num_workers=(\d+)\)", command.block)
        assert workers, f"{command.where}: no ScalingConfig(num_workers=N) in its block"
        argv = small([*argv, "--nproc", workers[1]], how, self.where, 1)
        return [run_forked(argv, {}, self.where)]

    def _machines(self, k: int, command: DocCommand, how: How) -> list[Ran]:
        """The machines of one job at once: ``how.machines`` copies of the command, or every command
        of its ``together`` group (which then count as run)."""
        port = free_port()
        members = [k] if how.machines else [j for j, c in enumerate(self.commands) if how_of(c).together == how.together]
        machines = []
        for j in members:
            member = self.commands[j]
            call = invocation(words_of(substituted(member.text, how_of(member), port)) or [])
            assert call is not None, member
            steps = self.steps_for(call.argv)
            for _ in range(how.machines or 1):
                machines.append((scaleloop_argv(small(call.argv, how_of(member), self.where, steps)),
                                 {**call.env, **dict(how.env)}, self.where))
        ran = run_together(machines, self.where / "groups")
        for j in members:
            self.results[j] = ran
        return ran

    def _pods(self, command: DocCommand, how: How) -> list[Ran]:
        """Every pod of a manifest's job at once, each with the variables its operator gives it
        (derived from the manifest as tests/runtime/test_kubeflow.py derives them), the service
        names of the master or rendezvous replaced by this machine's address, and the job's port by
        a free one. The pods share the volume under ``/runs`` (the page's ReadWriteMany claim)."""
        from test_kubeflow import pytorchjob_env, trainjob_env

        job = yaml.safe_load(command.block)
        spec = job["spec"]
        if job["kind"] == "TrainJob":
            pods = [trainjob_env(job, i) for i in range(int(spec["trainer"]["numNodes"]))]
        else:
            replicas = spec["pytorchReplicaSpecs"]
            pods = [pytorchjob_env(job, rtype, i) for rtype in ("Master", "Worker") if rtype in replicas
                    for i in range(int(replicas[rtype]["replicas"]))]
        port = free_port()
        call = invocation(words_of(command.text) or [])
        assert call is not None
        argv = scaleloop_argv(small(call.argv, how, self.where, self.steps_for(call.argv)))
        machines = []
        for k, env in enumerate(pods):
            env = {**env, "PYTHONUNBUFFERED": "1"}
            for name in ("MASTER_ADDR", "PET_MASTER_ADDR"):
                if name in env:
                    env[name] = "127.0.0.1"
            for name in ("MASTER_PORT", "PET_MASTER_PORT"):
                if name in env:
                    env[name] = str(port)
            if "PET_RDZV_ENDPOINT" in env:
                env["PET_RDZV_ENDPOINT"] = f"127.0.0.1:{port}"
            machines.append((argv, env, self.where / "pods" / f"{job['metadata']['name']}-{k}"))
        return run_together(machines, self.where / "groups")

    def _srun(self, command: DocCommand, how: How) -> list[Ran]:
        """A batch script's ``srun`` line: one task a node (``#SBATCH --nodes``) at once, each with
        the variables srun gives a task, in the job's working directory (shared, as on a cluster).
        The port rank 0 listens on derives from the job id: one whose port is free here."""
        from test_slurm_dist import free_job_id

        nodes = int(re.search(r"^#SBATCH --nodes=(\d+)", command.block, re.M)[1])
        job_id, port = free_job_id(), free_port()
        machines = []
        for rank in range(nodes):
            env = {"SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
                   "SLURM_NTASKS": str(nodes), "SLURM_LOCALID": "0", "SLURM_NODEID": str(rank),
                   "SLURM_NNODES": str(nodes), "SLURM_TASKS_PER_NODE": f"1(x{nodes})",
                   "SLURM_JOB_NODELIST": ",".join(["localhost"] * nodes), "SLURM_CPUS_PER_TASK": "1",
                   "OMP_NUM_THREADS": "1", "HOME": str(self.where / "home"), "head": "127.0.0.1"}
            text = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m[1], m[0]), substituted(command.text, how, port))
            call = invocation(words_of(text) or [])
            assert call is not None and call.srun, command
            argv = small(call.argv, how, self.where, 1)   # --out runs/$SLURM_JOB_ID: a new run each time
            line = (scaleloop_argv(argv) if call.torchrun is None else
                    [sys.executable, "-m", "torch.distributed.run", *call.torchrun, "-m", "scaleloop", *argv])
            machines.append((line, {k: v for k, v in env.items() if k != "head"}, self.where))
        return run_together(machines, self.where / "groups")

    def failures(self) -> list[str]:
        """What went wrong, one entry a command: its exit code or a missing line of its output."""
        problems = []
        for k, ran in sorted(self.results.items()):
            command, how = self.commands[k], how_of(self.commands[k])
            for machine, one in enumerate(ran):
                label = f"{command.where} ({command.text})" + (f", machine {machine}" if len(ran) > 1 else "")
                if one.code != how.expect:
                    problems.append(f"{label}: exit code {one.code}, not {how.expect}; ran scaleloop "
                                    f"{shlex.join(map(str, one.argv[3:] if one.argv[:1] == [sys.executable] else one.argv))}"
                                    f"\n{one.output[-4000:]}")
                    continue
            if how.shows and ran:
                try:
                    check_output(list(how.shows), "\n".join(one.output for one in ran), f"{command.where}")
                except AssertionError as exc:
                    problems.append(str(exc))
        return problems
