"""The pages whose commands start several processes: each page's commands run in order in one
scratch directory, as tests/doc_commands.py says (one-process pages: tests/test_doc_commands.py).

Besides each command's exit code and the lines the page shows, the Kubernetes manifests' pods
are checked for what a pod must not print on a fresh start in an empty, shared ``--out`` (a note
that a run "stopped before its first step"), and a job whose command is a usage error is checked
to say so in one line on every pod.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from doc_commands import PAGES, ROOT, DocCommand, How, PageRun, commands_of, how_of, is_multiprocess  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MULTI_PROCESS_PAGES = [str(p.relative_to(ROOT)) for p in PAGES
                       if any(is_multiprocess(c, how_of(c)) for c in commands_of(p))]
# What no pod of a job that starts fresh may print.
MISLEADING = ("stopped before its first step", "no Python error")


@pytest.mark.parametrize("page", MULTI_PROCESS_PAGES)
def test_the_commands_of_a_multi_process_page_run(page: str, tmp_path: Path) -> None:
    run = PageRun(page, tmp_path)
    run.run_all()
    problems = run.failures()
    assert not problems, "\n\n".join(problems)
    if page == "docs/kubernetes.md":
        pods_say_nothing_misleading(run)


def pods_say_nothing_misleading(run: PageRun) -> None:
    jobs = [(run.commands[k], ran) for k, ran in run.results.items() if run.commands[k].source == "manifest"]
    assert len(jobs) == 3, [c.where for c, _ in jobs]
    for command, pods in jobs:
        name = yaml.safe_load(command.block)["metadata"]["name"]
        assert len(pods) >= 2, name
        for k, pod in enumerate(pods):
            said = [line for line in pod.output.splitlines() if any(m in line for m in MISLEADING)]
            assert not said, f"{name}, pod {k}, on a fresh start in an empty --out:\n" + "\n".join(said)
            assert pod.output.startswith("scaleloop: kubernetes ("), pod.output[:300]
        # Rank 0's pod prints the run; the others print nothing of it.
        assert sum("\nsummary\n" in pod.output for pod in pods) == 1, name


def test_a_usage_error_in_a_jobs_command_is_one_line_on_every_pod(tmp_path: Path) -> None:
    """The PyTorchJob of docs/kubernetes.md with a model and data that do not fit together (what
    its command was): every pod says the error once, in one line, and exits with 2."""
    page = "docs/kubernetes.md"
    job = next(c for c in commands_of(ROOT / page) if c.source == "manifest" and "nprocPerNode" in c.block)
    broken_block = job.block.replace("--data, digits", "--data, random")
    assert broken_block != job.block
    broken = DocCommand(page, job.line, job.text.replace("--data digits", "--data random"), "manifest", broken_block)
    run = PageRun(page, tmp_path)
    pods = run._pods(broken, How(page, "", run_as="pods", flags=("--device", "cpu")))
    message = ("scaleloop: error: model 'convnet' needs image data shaped (channels, height, width); dataset "
               "'random' gives samples shaped (20,)")
    for k, pod in enumerate(pods):
        errors = [line for line in pod.output.splitlines() if line.startswith("scaleloop: error:")]
        assert pod.code == 2 and len(errors) == 1 and errors[0].startswith(message), (
            f"pod {k} (exit code {pod.code}):\n{pod.output}")
        said = [line for line in pod.output.splitlines() if any(m in line for m in MISLEADING)]
        assert not said, f"pod {k}:\n{pod.output}"
        assert not any(line.startswith("  ") for line in pod.output.splitlines()[pod.output.splitlines().index(errors[0]):]), (
            f"pod {k}: the error is more than one line:\n{pod.output}")
