"""Tests for scaleloop.runtime.devices and DistEnv.from_env (on this machine's CPU)."""
from __future__ import annotations

import time

import pytest
import torch

from scaleloop.runtime.devices import (best_device, choose_device, describe_device, device_clock,
                                       device_for_local_rank, indexed, resolve_device, to_cpu,
                                       use_deterministic_cuda)
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
    assert device_for_local_rank(pinned, 0) == pinned  # an explicit index is kept (one process)
    assert device_for_local_rank(torch.device("cuda"), 3) == torch.device("cuda", 3)


# --- choose_device: the rule, for any machine (a pure function; no GPU needed) ------------

@pytest.mark.parametrize("requested,procs,gpus,expected", [
    ("auto", 1, 0, "cpu"), ("auto", 4, 0, "cpu"), ("auto", 1, 1, "cuda"), ("auto", 2, 2, "cuda"),
    ("auto", 8, 8, "cuda"), ("cuda", 1, 1, "cuda"), ("cuda", 2, 4, "cuda"), ("cuda:1", 1, 2, "cuda:1"),
    ("cpu", 4, 8, "cpu"), (" CUDA ", 1, 1, "cuda")])
def test_choose_device_fits(requested: str, procs: int, gpus: int, expected: str) -> None:
    choice = choose_device(requested, procs, gpus)
    assert choice.device == torch.device(expected) and choice.note is None


def test_auto_with_more_processes_than_gpus_falls_back_to_the_cpu_and_says_so() -> None:
    choice = choose_device("auto", 2, 1)
    assert choice.device == torch.device("cpu")
    assert choice.note is not None and "\n" not in choice.note
    assert "2 processes" in choice.note and "1 GPU" in choice.note and "--nproc 1" in choice.note


@pytest.mark.parametrize("requested,procs,gpus,match", [
    ("cuda", 2, 1, "2 processes on this machine, but it has 1 GPU.*use --nproc 1, or --device cpu"),
    ("cuda", 3, 2, "use --nproc 2"),
    ("cuda:0", 2, 2, "puts all 2 processes on one GPU.*use --device cuda"),
    ("cuda:2", 1, 2, "only 2 CUDA device"),
    ("cuda", 1, 0, "CUDA is not available"),
    ("mps", 1, 0, "MPS")])
def test_choose_device_refuses_in_one_line(requested: str, procs: int, gpus: int, match: str) -> None:
    with pytest.raises(UsageError, match=match) as info:
        choose_device(requested, procs, gpus)
    assert "\n" not in str(info.value)


def test_auto_prefers_mps_for_one_process_without_cuda() -> None:
    assert choose_device("auto", 1, 0, mps=True).device == torch.device("mps")


def test_indexed_names_the_gpu() -> None:
    # FSDP's one-rank group passes this to init_process_group(device_id=...), which needs an index.
    assert indexed(torch.device("cuda"), current=2) == torch.device("cuda", 2)
    assert indexed(torch.device("cuda", 1), current=2) == torch.device("cuda", 1)
    assert indexed(torch.device("cpu"), current=2) == torch.device("cpu")


def test_device_clock_on_the_cpu_is_the_plain_clock() -> None:
    before = time.perf_counter()
    assert before <= device_clock(torch.device("cpu")) <= time.perf_counter()


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


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: the fallback only happens where GPUs exist")
def test_from_env_auto_falls_back_to_gloo_when_gpus_are_too_few(capsys) -> None:
    n = torch.cuda.device_count()
    env = DistEnv.from_env({"RANK": "0", "WORLD_SIZE": str(n + 1), "LOCAL_RANK": "0"}, device="auto")
    assert env.device == torch.device("cpu") and env.backend == "gloo"
    assert "NCCL needs one GPU per process" in capsys.readouterr().err
    with pytest.raises(UsageError, match="NCCL needs one GPU per process"):
        DistEnv.from_env({"RANK": "0", "WORLD_SIZE": str(n + 1), "LOCAL_RANK": "0"}, device="cuda")


def test_to_cpu_keeps_the_structure_and_detaches() -> None:
    model = torch.nn.BatchNorm1d(3)
    state = model.state_dict()
    state["extra"] = [torch.ones(2, requires_grad=True), (torch.zeros(1), "text")]
    moved = to_cpu(state)
    assert type(moved) is type(state) and list(moved) == list(state)
    assert moved._metadata == state._metadata  # load_state_dict reads module versions from it
    assert not moved["extra"][0].requires_grad and moved["extra"][1][1] == "text"
    assert isinstance(moved["extra"][1], tuple)
    assert torch.equal(moved["running_mean"], state["running_mean"])


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_to_cpu_moves_cuda_tensors() -> None:
    moved = to_cpu({"w": torch.ones(2, device="cuda")})
    assert moved["w"].device == torch.device("cpu")


def test_deterministic_mode_sets_the_cublas_workspace_and_torch_flags() -> None:
    environ: dict[str, str] = {}
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark)
    try:
        use_deterministic_cuda(environ)
        assert environ == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        kept = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
        use_deterministic_cuda(kept)   # the user's own setting wins
        assert kept["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1], before[2]
