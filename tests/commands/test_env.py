"""Tests for scaleloop.commands.env on the CPU-only development machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scaleloop.commands.env import collect_env, format_env
from scaleloop.strategies.registry import REGISTRY

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="expects a CPU-only machine")


@pytest.fixture(scope="module")
def info() -> dict[str, object]:
    return collect_env()


def test_keys_and_types(info: dict[str, object]) -> None:
    expected_types: dict[str, type | tuple[type, ...]] = {
        "python": str,
        "platform": str,
        "torch": str,
        "cuda_available": bool,
        "gpu_count": int,
        "gpus": list,
        "nccl_available": bool,
        "gloo_available": bool,
        "mpi_available": bool,
        "mps_available": bool,
        "cpu_count": int,
        "torch_threads": int,
        "bf16_cpu": bool,
        "best_device": str,
        "strategies": dict,
    }
    for key, typ in expected_types.items():
        assert key in info, key
        assert isinstance(info[key], typ), (key, info[key])
    assert info["torch"] == torch.__version__
    assert info["torch_cuda"] == torch.version.cuda
    assert info["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["gpu_count"] == len(info["gpus"])  # type: ignore[arg-type]
    assert info["torch_threads"] == torch.get_num_threads()
    assert info["best_device"] in {"cuda", "mps", "cpu"}
    if hasattr(os, "sched_getaffinity"):
        affinity = info["cpu_affinity"]
        assert isinstance(affinity, int) and 1 <= affinity <= info["cpu_count"]  # type: ignore[operator]


def test_gpu_entries_are_described(info: dict[str, object]) -> None:
    if not info["gpus"]:
        pytest.skip("needs a CUDA GPU: each GPU's entry is checked (CPU machines: test_cpu_machine_facts)")
    for gpu in info["gpus"]:  # type: ignore[attr-defined]
        assert set(gpu) == {"index", "name", "memory_gib", "capability"}
        assert gpu["memory_gib"] > 0
        major, minor = gpu["capability"].split(".")
        assert major.isdigit() and minor.isdigit()


@cpu_only
def test_cpu_machine_facts(info: dict[str, object]) -> None:
    assert info["cuda_available"] is False
    assert info["gpu_count"] == 0 and info["gpus"] == []
    assert info["best_device"] in {"cpu", "mps"}
    if not info["mps_available"]:
        assert info["best_device"] == "cpu"
    assert info["gloo_available"] is True
    if torch.version.cuda is None:  # a CUDA build of torch reports NCCL even on a machine without GPUs
        assert info["nccl_available"] is False
        assert info["nccl_version"] is None
    assert info["bf16_cuda"] is None


def test_strategies_structure(info: dict[str, object]) -> None:
    strategies = info["strategies"]
    assert isinstance(strategies, dict)
    assert tuple(strategies) == tuple(REGISTRY)
    for name, (runnable, reason) in strategies.items():
        assert isinstance(runnable, bool), name
        assert isinstance(reason, str) and reason, name
    assert strategies["single"][0] is True
    # allreduce uses exactly the same process groups as ddp.
    assert strategies["allreduce"] == strategies["ddp"]


@cpu_only
def test_strategies_on_cpu(info: dict[str, object]) -> None:
    strategies = info["strategies"]
    assert isinstance(strategies, dict)
    runnable_dp, reason_dp = strategies["dp"]
    assert runnable_dp is False
    assert "CUDA" in reason_dp
    # Gloo is present, so multi-process CPU runs are possible: the tests run pipeline and mesh on it.
    for name in ("ddp", "fsdp", "pipeline", "mesh"):
        assert strategies[name][0] is True, name
        assert "Gloo" in strategies[name][1], name


def test_every_registered_strategy_is_listed() -> None:
    from scaleloop.config import STRATEGIES

    assert {"auto", *REGISTRY} == set(STRATEGIES)   # every name --strategy accepts, but auto
    assert {"pipeline", "mesh"} <= set(REGISTRY)


def test_a_torch_without_the_apis_marks_them_not_runnable() -> None:
    from scaleloop.commands.env import _strategies

    strategies = _strategies(0, gloo=True, nccl=False, api_ok=lambda api: False)
    for name, module in (("fsdp", "fully_shard"), ("pipeline", "pipelining"), ("mesh", "device_mesh")):
        runnable, reason = strategies[name]
        assert runnable is False and module in reason, name


def test_format_env_sections(info: dict[str, object]) -> None:
    text = format_env(info)
    for section in (
        "Python / torch",
        "Devices",
        "Distributed backends",
        "Strategies runnable here",
    ):
        assert section in text.splitlines(), section
    assert str(torch.__version__) in text
    text.encode("ascii")  # must print on any terminal
    strategy_block = text.split("Strategies runnable here", 1)[1]
    for name in REGISTRY:
        assert f"  {name} " in strategy_block
    single_line = next(line for line in strategy_block.splitlines() if line.strip().startswith("single"))
    assert " yes " in single_line


@cpu_only
def test_format_env_marks_dp_not_runnable(info: dict[str, object]) -> None:
    text = format_env(info)
    dp_line = next(line for line in text.splitlines() if line.strip().startswith("dp "))
    assert " no " in dp_line
    gloo_line = next(line for line in text.splitlines() if line.strip().startswith("Gloo"))
    assert gloo_line.split()[-1] == "yes"


def test_format_env_with_fake_gpus() -> None:
    fake: dict[str, object] = {
        "python": "3.11.0",
        "platform": "Linux",
        "torch": "9.9.9",
        "torch_cuda": "12.4",
        "cuda_available": True,
        "gpu_count": 2,
        "gpus": [
            {"index": 0, "name": "FakeGPU A", "memory_gib": 79.1, "capability": "9.0"},
            {"index": 1, "name": "FakeGPU B", "memory_gib": 79.1, "capability": "9.0"},
        ],
        "nccl_available": True,
        "nccl_version": "2.21.5",
        "gloo_available": True,
        "mpi_available": False,
        "mps_available": False,
        "cpu_count": 16,
        "cpu_affinity": 8,
        "torch_threads": 8,
        "bf16_cpu": True,
        "bf16_cuda": True,
        "best_device": "cuda",
        "strategies": {"single": (True, "ok"), "dp": (True, "2 CUDA GPU(s)")},
    }
    text = format_env(fake)
    assert "FakeGPU B, 79.1 GiB, compute 9.0" in text
    assert "2.21.5" in text
    assert "8 usable" in text


def test_import_does_not_load_torch() -> None:
    # Compare before/after so a package __init__ that needs torch does not mask
    # what this module itself imports.
    code = (
        "import sys, scaleloop\n"
        "before = 'torch' in sys.modules\n"
        "import scaleloop.commands.env\n"
        "print(before or 'torch' not in sys.modules)\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "True"
