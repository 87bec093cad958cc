"""The examples/ scripts that run as one plain process: each runs, and does what its docstring says.

The ones started by torchrun (02-05) and 06 (which starts workers itself) are tested in
tests/distributed/test_examples_dist.py, where the suite's no-process-left-behind check applies.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
from procs import child_env, run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))


def run_example(name: str, *args: str, cwd: Path) -> str:
    """``python examples/<name> <args>`` as a reader runs it; returns its output, asserts success."""
    return run_example_process(name, *args, cwd=cwd).stdout


def run_example_process(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """As :func:`run_example`, with the standard error too."""
    res = run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, timeout=120,
              env=child_env({"OMP_NUM_THREADS": "1"}))
    assert res.returncode == 0, f"{name} {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res


def _has(module: str) -> bool:
    """Whether ``module`` is installed. An installed one that fails to import fails its tests
    (a broken install must not pass as a skip)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over all tensors, relative to the largest weight of ``a``."""
    assert a.keys() == b.keys()
    scale = max(t.abs().max().item() for t in a.values())
    return max((a[k] - b[k]).abs().max().item() for k in a) / scale


def step_losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+): loss ([0-9.]+)$", output, re.M)}


def test_the_examples_are_a_numbered_sequence() -> None:
    numbers = [int(p.name[:2]) for p in SCRIPTS]
    assert numbers == list(range(len(SCRIPTS))) and len(SCRIPTS) >= 7, [p.name for p in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_docstring_says_what_changed_and_how_to_run(script: Path) -> None:
    doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8")))
    assert doc, f"{script.name} has no docstring"
    number = script.name[:2]
    assert doc.startswith(f"{number} — "), f"{script.name}: the docstring should start with '{number} — '"
    # How to run it: the command line with this very file in it.
    assert re.search(rf"^\s+(python|torchrun) .*examples/{re.escape(script.name)}", doc, re.M), \
        f"{script.name}: the docstring should show the command that runs it"
    if number != "00":
        # What changed: every later example names the one it is a diff from, and that file exists.
        earlier = [n for n in re.findall(r"(\d\d_\w+\.py)", doc) if n != script.name]
        assert earlier, f"{script.name}: the docstring should name the example it changes"
        assert all((EXAMPLES / n).exists() for n in earlier), earlier
        assert "diff from" in doc, f"{script.name}: the docstring should say what the diff from the previous one is"


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    """00_single.py's output and final weights: the reference the later examples are held to."""
    tmp = tmp_path_factory.mktemp("ex00")
    out = run_example("00_single.py", "--out", str(tmp / "w.pt"), cwd=tmp)
    return out, weights(tmp / "w.pt")


@pytest.mark.slow
def test_00_single_trains(single: tuple[str, dict[str, torch.Tensor]]) -> None:
    out, w = single
    assert re.search(r"^rank 0/1: 30 steps, last loss 0\.\d{4}$", out, re.M), out
    assert set(w) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}


@pytest.mark.slow
def test_01_dataparallel_without_gpu_says_so_and_equals_00(tmp_path: Path, single) -> None:
    out = run_example("01_dataparallel.py", "--out", str(tmp_path / "w.pt"), cwd=tmp_path)
    if torch.cuda.is_available():
        assert "nn.DataParallel over" in out
        assert rel_diff(single[1], {k: v.cpu() for k, v in weights(tmp_path / "w.pt").items()}) <= 1e-5
    else:
        # The fallback to one CPU process is said, not silent; it is then 00's computation exactly.
        assert "no CUDA GPU: nn.DataParallel needs one, so this runs 'single' on the CPU" in out
        a, b = single[1], weights(tmp_path / "w.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_03_accumulation_alone_changes_nothing_but_rounding(tmp_path: Path, single) -> None:
    # One process, 4 micro-steps of 32 samples, fp32: the same update as 00's one batch of 128.
    out = run_example("03_accumulate_bf16.py", "--precision", "fp32", "--accumulate", "4",
                      "--out", str(tmp_path / "w.pt"), cwd=tmp_path)
    assert "rank 0/1: 30 steps, fp32, accumulate 4" in out
    assert rel_diff(single[1], weights(tmp_path / "w.pt")) <= 1e-5
    # The loss printed is the whole step's: at step 30 it is the loss 00 prints for its last batch.
    last_00 = float(re.search(r"last loss ([0-9.]+)", single[0]).group(1))
    assert abs(step_losses(out)[30] - last_00) <= 1e-4


@pytest.mark.slow
@pytest.mark.skipif(not _has("transformers"), reason="07 needs transformers (a test extra: pip install -e '.[dev]')")
def test_07_huggingface_model_in_the_loop_learns(tmp_path: Path) -> None:
    res = run_example_process("07_huggingface.py", "--out", str(tmp_path / "w.pt"), cwd=tmp_path)
    out = res.stdout
    assert "[transformers]" not in res.stderr, res.stderr   # the config says what transformers would warn about
    losses = step_losses(out)
    assert sorted(losses) == [5, 10, 15, 20], out
    assert losses[20] < losses[5], out
    assert re.search(r"^rank 0/1: 20 steps, last loss \d\.\d{4}$", out, re.M), out
    assert "transformer.h.0.attn.c_attn.weight" in weights(tmp_path / "w.pt")
