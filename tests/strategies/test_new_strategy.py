"""A new strategy is one module and one registry entry (issue 54, point 3).

A toy strategy is written into a module of its own, outside scaleloop, and registered with one
entry in ``REGISTRY`` at run time, nothing else: ``scaleloop train`` accepts and trains it,
``--help-all`` offers it, ``scaleloop env`` lists it, ``scaleloop bench`` runs it, and the option
checks name it. The pages that tell a reader how to add one are checked against the code too.
"""
from __future__ import annotations

import dataclasses
import io
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Iterator

import pytest

from scaleloop.cli import main
from scaleloop.errors import UsageError
from scaleloop.strategies.registry import REGISTRY, STRATEGIES, ParallelSettings, Registered

ROOT = Path(__file__).resolve().parents[2]

TOY_MODULE = "scaleloop_test_toy_strategy"
TOY_SOURCE = '''
"""A strategy that lives outside scaleloop: DistributedDataParallel under another name."""
from scaleloop.strategies.ddp import DDP


class Toy(DDP):
    name = "toy"
'''


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registered]:
    """The toy's module on ``sys.path`` and its one entry in REGISTRY (removed afterwards)."""
    (tmp_path / f"{TOY_MODULE}.py").write_text(TOY_SOURCE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    # Everything the CLI, env and bench know of a strategy is in its entry: the toy's are DDP's.
    entry = dataclasses.replace(REGISTRY["ddp"], name="toy", cls=f"{TOY_MODULE}:Toy")
    monkeypatch.setitem(REGISTRY, "toy", entry)
    yield entry
    sys.modules.pop(TOY_MODULE, None)


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:   # --help
            code = int(exit_.code or 0)
    return code, out.getvalue(), err.getvalue()


def test_train_accepts_and_trains_it(toy: Registered, tmp_path: Path) -> None:
    code, out, err = run_cli("train", "--strategy", "toy", "--max-steps", "2", "--data", "random",
                             "--n-samples", "128", "--batch-size", "32", "--device", "cpu", "--no-progress",
                             "--no-tensorboard", "--out", str(tmp_path / "run"))
    assert code == 0, err
    assert "toy" in out[out.index("summary"):]
    assert (tmp_path / "run" / "metrics.csv").is_file()


def test_the_cli_offers_it(toy: Registered) -> None:
    assert "toy" in STRATEGIES   # what --strategy accepts, read from REGISTRY when asked
    code, out, _ = run_cli("train", "--help-all")
    assert code == 0
    assert "|mesh|toy)" in out


def test_env_lists_it(toy: Registered) -> None:
    from scaleloop.commands.env import collect_env, format_env

    info = collect_env()
    assert list(info["strategies"]) == list(REGISTRY)   # type: ignore[arg-type]
    assert info["strategies"]["toy"] == info["strategies"]["ddp"]   # type: ignore[index]
    block = format_env(info).split("Strategies runnable here", 1)[1]
    assert "\n  toy " in block


def test_bench_runs_it(toy: Registered) -> None:
    from scaleloop.bench import scaling, strategies
    from scaleloop.bench.workload import Workload

    assert strategies.benchmarked()[-1] == "toy"
    opts = strategies.StrategiesOptions(workload=Workload(), workers=2)
    rows = strategies.table_rows(opts, "cpu", 0)
    assert [r.label for r in rows if r.strategy == "toy"] == ["toy x 2"]
    assert "toy" in scaling.scaling_strategies()
    scaling.check_options(scaling.ScalingOptions(workload=Workload(), workers=(1, 2), strategy="toy"), "cpu", 0)


def test_the_option_checks_know_it(toy: Registered) -> None:
    # What DDP takes, the toy takes (its entry says so) ...
    ParallelSettings(strategy="toy", find_unused_parameters=True, compile=True).check_layout(2, "1:2")
    # ... and the messages that list the strategies taking an option name it.
    with pytest.raises(UsageError, match=r"an elastic job runs ddp, allreduce, fsdp or toy$"):
        ParallelSettings(strategy="pipeline").check_layout(2, "1:2")
    with pytest.raises(UsageError, match=r"use it with --strategy ddp or --strategy toy \(not allreduce\)"):
        ParallelSettings(strategy="allreduce", static_graph=True).check_layout(2)


def test_the_lists_are_unchanged_without_it() -> None:
    """Derived from REGISTRY, the messages read as they did when they were written by hand."""
    from scaleloop.bench import scaling, strategies

    assert tuple(STRATEGIES) == ("auto", "single", "dp", "ddp", "allreduce", "fsdp", "pipeline", "mesh")
    assert strategies.benchmarked() == ("single", "dp", "ddp", "allreduce", "fsdp")
    assert scaling.scaling_strategies() == ("ddp", "allreduce", "fsdp")
    cases = {
        "--static-graph is an option of DistributedDataParallel: use it with --strategy ddp (not fsdp)":
            dict(strategy="fsdp", static_graph=True),
        "--cpu-offload moves FSDP's shards to host memory: use it with --strategy fsdp or --mesh "
        "(not --strategy ddp)": dict(strategy="ddp", cpu_offload=True),
        "--activation-checkpointing is not offered with --strategy dp; use single, ddp, allreduce, fsdp or "
        "--mesh without pp": dict(strategy="dp", activation_checkpointing=True),
        "--compile does not support --strategy dp (nn.DataParallel): use --strategy ddp":
            dict(strategy="dp", compile=True),
        "--sharded-checkpoints applies to pipelines (fsdp and --mesh always write sharded checkpoints); with "
        "--strategy ddp every rank holds the whole model: drop it": dict(strategy="ddp", sharded_checkpoints=True),
    }
    for message, settings in cases.items():
        with pytest.raises(UsageError) as info:
            ParallelSettings(**settings).check_layout(1 if settings["strategy"] == "dp" else 2)
        assert str(info.value) == message
    with pytest.raises(UsageError) as info:
        ParallelSettings(strategy="dp").check_layout(2, "1:2")
    assert str(info.value).startswith("--strategy dp (nn.DataParallel) runs ONE process that drives all GPUs")
    ParallelSettings(strategy="ddp").check_layout(2, "1:2")   # an elastic ddp job: no error


# --- the pages that say how to add one ------------------------------------------------------

def adding_a_strategy_hooks() -> list[str]:
    """The hooks the hook table of docs/strategies.md's "Adding a strategy" names (its first column)."""
    page = (ROOT / "docs" / "strategies.md").read_text(encoding="utf-8")
    section = re.split(r"\n#{2,} ", page.split("### Adding a strategy", 1)[1])[0]   # to the next heading
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    names = [name for row in rows for name in re.findall(r"`(\w+)", row.split("|")[1])]
    assert names, "docs/strategies.md: no hook table under 'Adding a strategy'"
    return names


def test_every_hook_the_docs_name_exists() -> None:
    from scaleloop.strategies.base import Strategy

    dead = [name for name in adding_a_strategy_hooks() if not hasattr(Strategy, name)]
    assert not dead, f"docs/strategies.md names hooks that Strategy does not have: {', '.join(dead)}"


def test_the_readme_lists_the_registry() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = readme[readme.index("\nStrategies:"):]
    line = line[:line.index("\n\n")]
    # Each strategy is named as `name` (lower case, nothing else in the backticks), in the registry's order.
    named = re.findall(r"`([a-z]+)`", line)
    assert named == list(STRATEGIES)[1:] + ["auto"]
    layout = readme.split("## Layout", 1)[1]
    entry = layout[layout.index("  strategies/"):layout.index("  checkpoint/")]
    modules = [r.cls.split(":")[0].rsplit(".", 1)[1] for r in REGISTRY.values()]
    assert [m for m in modules if not re.search(rf"\b{m}\b", entry)] == []
