"""Every ``scaleloop`` command of README.md and docs/*.md runs (tests/doc_commands.py says how they
are found and made small): here the pages whose commands are all one process, run in this process;
tests/distributed/test_doc_commands_dist.py runs the pages with multi-process commands (Kubernetes
pods, SLURM tasks, several machines, torchrun workers). docs/tutorial.md and docs/from-the-post.md
are tests/test_docs.py's.

A command added to a page runs here without any change to the tests; one that cannot run as
written needs an entry in ``doc_commands.HOW`` saying what differs and why, and an entry that no
longer matches any command fails the inventory.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_commands import (HOW, PAGES, ROOT, DocCommand, PageRun, commands_of, config_flags, how_of,  # noqa: E402
                          invocation, is_multiprocess, small, words_of)

COMMANDS = {str(page.relative_to(ROOT)): commands_of(page) for page in PAGES}
ONE_PROCESS_PAGES = [page for page, found in COMMANDS.items()
                     if found and not any(is_multiprocess(c, how_of(c)) for c in found)]


def test_the_pages_commands_are_found() -> None:
    found = {page: len(commands) for page, commands in COMMANDS.items() if commands}
    # The pages that show scaleloop commands, with at least these many (more may be added).
    least = {"README.md": 2, "docs/checkpointing.md": 7, "docs/kubernetes.md": 5, "docs/multinode.md": 4,
             "docs/ray.md": 2, "docs/slurm.md": 2, "docs/strategies.md": 15, "docs/troubleshooting.md": 4,
             "docs/tracking.md": 5, "docs/verification.md": 3}
    short = {page: (found.get(page, 0), n) for page, n in least.items() if found.get(page, 0) < n}
    assert not short, f"fewer commands found than the pages show (found, expected): {short}"
    sources = {c.source for commands in COMMANDS.values() for c in commands}
    assert sources == {"shell", "script", "manifest", "python"}


def test_every_entry_of_how_matches_a_command_and_says_why() -> None:
    used = {how_of(c) for commands in COMMANDS.values() for c in commands}
    stale = [f"{h.page}: {h.match!r}" for h in HOW if h not in used]
    assert not stale, f"entries of doc_commands.HOW that match no command of their page: {stale}"
    unexplained = [h.match for h in HOW if (h.skip or h.flags or h.replace or h.env or h.run_as or h.here)
                   and not h.why]
    assert not unexplained, f"entries that change how a command runs without saying why: {unexplained}"


def test_a_skipped_command_is_no_command_or_is_run_as_another() -> None:
    for page, commands in COMMANDS.items():
        for command in commands:
            how = how_of(command)
            if how.skip and how.same_as:
                others = [c for c in commands if c.source == "manifest" and how.same_as in c.block]
                assert others, f"{command.where}: no manifest of {page} has {how.same_as!r}"
                for other in others:
                    assert words_of(command.text) == words_of(other.text), (
                        f"{command.where}: the page's command is not that of the manifest at {other.where}:\n"
                        f"  {command.text}\n  {other.text}")


def test_finding_commands_in_shell_lines() -> None:
    assert invocation(["scaleloop", "train", "--nproc", "2"]).argv == ["train", "--nproc", "2"]  # type: ignore[union-attr]
    call = invocation(["WANDB_MODE=offline", "scaleloop", "train"])
    assert call is not None and call.env == {"WANDB_MODE": "offline"}
    call = invocation(["srun", "python", "-m", "torch.distributed.run", "--nnodes=2", "-m", "scaleloop", "train"])
    assert call is not None and call.srun and call.torchrun == ["--nnodes=2"] and call.argv == ["train"]
    for other in (["torchrun", "train.py"], ["pip", "install", "scaleloop[ray]"], ["scaleloop:", "error"],
                  ["scaleloop", "plan:", "tinygpt"]):
        assert invocation(other) is None, other
    assert words_of("scaleloop train --nproc 2   # two processes") == ["scaleloop", "train", "--nproc", "2"]
    assert config_flags("TrainConfig(strategy='fsdp', epochs=1)") == ["--strategy=fsdp", "--epochs=1"]


def test_making_a_command_small(tmp_path: Path) -> None:
    how = how_of(DocCommand("docs/x.md", 1, "scaleloop train"))
    assert small(["train", "--data", "random", "--out", "/runs/a"], how, tmp_path, 2) == [
        "train", "--data", "random", "--out", str(tmp_path / "volume/runs/a"), "--n-samples", "64", "--max-steps", "2"]
    assert small(["train", "--model", "tinygpt", "--data", "tokens", "--n-samples", "512"], how, tmp_path, 1)[-4:] == [
        "--seq-len", "16", "--max-steps", "1"]
    assert small(["verify", "--data", "digits"], how, tmp_path, 1) == ["verify", "--data", "digits", "--steps", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("page", ONE_PROCESS_PAGES)
def test_the_commands_of_a_one_process_page_run(page: str, tmp_path: Path) -> None:
    run = PageRun(page, tmp_path)
    run.run_all()
    problems = run.failures()
    assert not problems, "\n\n".join(problems)
