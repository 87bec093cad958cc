"""Tests for scaleloop.runtime.devices and DistEnv.from_env (on this machine's CPU)."""
from __future__ import annotations

import pytest
import torch

from scaleloop.runtime.devices import best_device, describe_device, device_for_local_rank, resolve_device
from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError

HAS_CUDA = torch.cuda.is_available()
HAS_MPS = torch.backends.mps.is_available()


def test_auto_is_the_best_device() -> None:
    assert resolve_device("auto") == best_device()
    if not HAS_CUDA and not HAS_MPS:
        assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cpu", "CPU", " cpu "])
def test_cpu(spec: str) -> None:
    assert resolve_device(spec) == torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here, so --device cuda is not an error")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_usage_error(spec: str) -> None:
    with pytest.raises(UsageError, match="CUDA is not available"):
        resolve_device(spec)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_index_out_of_range() -> None:
    with pytest.raises(UsageError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.skipif(HAS_MPS, reason="MPS is available here")
def test_mps_without_mps_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="MPS"):
        resolve_device("mps")


@pytest.mark.parametrize("spec,match", [("bogus", "is not a device"), ("cuda:x", "is not a device"),
                                        ("meta", "is not supported")])
def test_bogus_devices(spec: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        resolve_device(spec)


def test_device_for_local_rank() -> None:
    cpu = torch.device("cpu")
    assert device_for_local_rank(cpu, 0) == cpu
    assert device_for_local_rank(cpu, 3) == cpu  # CPU is shared by all ranks
    pinned = torch.device("cuda", 1)
    assert device_for_local_rank(pinned, 3) == pinned  # an explicit index is kept
    if HAS_CUDA:
        n = torch.cuda.device_count()
        assert device_for_local_rank(torch.device("cuda"), n + 1) == torch.device("cuda", (n + 1) % n)


def test_describe_cpu() -> None:
    assert describe_device(torch.device("cpu")).startswith("cpu (")


# --- DistEnv.from_env -------------------------------------------------------------------

def test_from_env_default_is_a_single_process() -> None:
    env = DistEnv.from_env({}, device="cpu")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (0, 0, 1, 1)
    assert env.is_main and not env.is_distributed
    assert env.backend is None
    assert env.device == torch.device("cpu")
    assert env == DistEnv()


def test_from_env_reads_the_launcher_variables() -> None:
    env = DistEnv.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                           device="cpu")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert not env.is_main and env.is_distributed
    assert env.backend == "gloo"  # CPU with several processes
    assert env.device == torch.device("cpu")


def test_from_env_local_world_size_defaults_to_world_size() -> None:
    env = DistEnv.from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, device="cpu")
    assert env.local_world_size == 2 and env.backend == "gloo" and env.is_main


def test_from_env_keeps_an_explicit_backend() -> None:
    env = DistEnv.from_env({"RANK": "0", "WORLD_SIZE": "2"}, device="cpu", backend="mpi")
    assert env.backend == "mpi"


@pytest.mark.parametrize("environ", [{"RANK": "x", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "two"},
                                     {"LOCAL_RANK": "1.5"}, {"RANK": "2", "WORLD_SIZE": "2"},
                                     {"RANK": "-1", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "0"}])
def test_from_env_bad_values(environ: dict[str, str]) -> None:
    with pytest.raises(UsageError, match="launcher environment"):
        DistEnv.from_env(environ, device="cpu")


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is available here")
def test_from_env_bad_device() -> None:
    with pytest.raises(UsageError, match="CUDA is not available"):
        DistEnv.from_env({}, device="cuda")
