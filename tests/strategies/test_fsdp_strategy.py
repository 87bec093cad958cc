"""--strategy fsdp in one process: the unit rule, errors, the one-rank path, sharded checkpoints.

The multi-process behaviour (2 ranks equal 1, resume 2 -> 1 -> 2, fp16, evaluation) is in
tests/distributed/test_fsdp.py. Here FSDP runs on a one-rank process group that the strategy
starts itself, in this process.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.checkpoint.store import CheckpointError, verify_checkpoint
from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.loop.training import train
from scaleloop.output.footprint import RankMemory, format_table, summary_line
from scaleloop.models import BiggerNet, ConvNet, SimpleNet, TinyGPT
import scaleloop
from scaleloop.strategies import FSDP
from scaleloop.strategies.fsdp import fsdp_blocks

CPU = DistEnv()


@pytest.fixture(autouse=True)
def no_group_left() -> Iterator[None]:
    yield
    if torch_dist.is_initialized():  # a failed test must not leave its group to the next one
        torch_dist.destroy_process_group()


def quiet(_msg: str) -> None:
    pass


def cfg(tmp_path: Path, name: str, **changes) -> TrainConfig:
    base = dict(data="random", n_samples=256, epochs=1, batch_size=32, optimizer="adam", lr=0.01,
                out=str(tmp_path / name), progress=False, tensorboard=False, device="cpu", log_every=2)
    base.update(changes)
    return TrainConfig(**base).validate()


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --- which modules become units ------------------------------------------------------------
def test_units_of_the_builtin_models() -> None:
    mlp = SimpleNet(4, 8, 2)
    assert fsdp_blocks(mlp) == [mlp.net[0], mlp.net[2]]
    bigger = BiggerNet(4, 8, 2)
    assert fsdp_blocks(bigger) == [bigger.net[0], bigger.net[2], bigger.net[4]]
    conv = ConvNet(1, 10, (8, 8))
    assert fsdp_blocks(conv) == [conv.features, conv.head]
    gpt = TinyGPT(vocab_size=16, seq_len=8, d_model=16, n_layers=3, n_heads=2)
    assert fsdp_blocks(gpt) == list(gpt.blocks)


def test_a_model_can_name_its_own_units() -> None:
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

        def fsdp_blocks(self):
            return [self.a, self.c]

    model = Custom()
    assert fsdp_blocks(model) == [model.a, model.c]


def test_a_single_layer_is_only_the_root_unit() -> None:
    assert fsdp_blocks(nn.Linear(3, 3)) == []
    wrapped = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3)))
    assert fsdp_blocks(wrapped) == [wrapped[0][0], wrapped[0][2]]


# --- errors ----------------------------------------------------------------------------------
def test_a_model_without_parameters_is_refused_in_one_line() -> None:
    strategy = scaleloop.strategy("fsdp", CPU)
    with pytest.raises(UsageError, match="has none; use --strategy ddp or single") as info:
        strategy.setup(nn.ReLU(), lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert "\n" not in str(info.value)
    assert not torch_dist.is_initialized()


def test_mps_is_refused() -> None:
    with pytest.raises(UsageError, match="CUDA GPUs .* or on the CPU"):
        FSDP(DistEnv(device=torch.device("mps")))


def test_fsdp_is_a_strategy_choice() -> None:
    assert TrainConfig(strategy="fsdp", nproc=2).validate().strategy == "fsdp"


# --- one process: the same code path as N ----------------------------------------------------
def test_one_process_fsdp_trains_like_single_and_writes_a_sharded_checkpoint(tmp_path: Path) -> None:
    single = train(cfg(tmp_path, "single"), CPU, log=quiet)
    result = train(cfg(tmp_path, "fsdp", strategy="fsdp"), CPU, log=quiet)
    assert not torch_dist.is_initialized(), "the strategy's own one-rank group outlived the run"
    assert result.strategy.startswith("fsdp (3 units: 2 x Linear + root)")
    assert max_diff(weights(single.run_dir), weights(result.run_dir)) <= 1e-6
    ckpt = verify_checkpoint(result.last_checkpoint)
    files = set(ckpt.meta["files"])
    assert {"state.pt", ".metadata", "__0_0.distcp"} <= files, files
    assert ckpt.meta["sharded"] == "torch.distributed.checkpoint"
    memory = json.loads((result.run_dir / "memory.json").read_text())
    assert memory["strategy"] == "fsdp" and memory["world_size"] == 1
    rank0 = memory["ranks"][0]
    assert rank0["parameters"] == rank0["model_parameters"] == rank0["gradients"] > 0
    assert rank0["optimizer"] >= 2 * rank0["parameters"]  # Adam: two moments per parameter


def test_a_damaged_shard_is_named(tmp_path: Path) -> None:
    result = train(cfg(tmp_path, "fsdp", strategy="fsdp", max_steps=2), CPU, log=quiet)
    shard = result.last_checkpoint / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.distcp.* is corrupt"):
        verify_checkpoint(result.last_checkpoint)


@pytest.mark.parametrize("first,then", [("single", "fsdp"), ("fsdp", "single")])
def test_resume_across_replicated_and_sharded_checkpoints(tmp_path: Path, first: str, then: str) -> None:
    whole = train(cfg(tmp_path, "whole", max_steps=6), CPU, log=quiet)
    train(cfg(tmp_path, "run", strategy=first, max_steps=3, checkpoint_every=3), CPU, log=quiet)
    msgs: list[str] = []
    resumed = train(cfg(tmp_path, "run", strategy=then, max_steps=6), CPU, log=msgs.append)
    assert any("resuming from" in m for m in msgs), msgs
    assert resumed.steps == 6
    assert max_diff(weights(whole.run_dir), weights(resumed.run_dir)) <= 1e-6


# --- the memory report -----------------------------------------------------------------------
def test_memory_table_and_summary_line() -> None:
    ranks = [RankMemory(rank=r, parameters=500, gradients=500, optimizer=1000, model_parameters=1000)
             for r in range(2)]
    table = format_table(ranks)
    assert "50.0%" in table and len(table.splitlines()) == 4
    line = summary_line(ranks)
    assert line.startswith("2.0 KiB on the largest of 2 ranks: parameters 500 B (50% of the model)")
    assert "peak CUDA" not in line
    one = summary_line(ranks[:1])
    assert one.startswith("2.0 KiB: parameters 500 B")


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fused_optimizer_steps_on_sharded_parameters(tmp_path: Path, optimizer: str) -> None:
    """--fused-optimizer with FSDP: DTensor has no rule for the fused SGD kernel (the first step
    raised NotImplementedError), so SGD takes the multi-tensor loop there; fused Adam runs."""
    plain = train(cfg(tmp_path, "plain", strategy="fsdp", optimizer=optimizer), CPU, log=quiet)
    fused = train(cfg(tmp_path, "fused", strategy="fsdp", optimizer=optimizer, fused_optimizer=True), CPU, log=quiet)
    assert fused.steps == plain.steps > 0
    assert max_diff(weights(plain.run_dir), weights(fused.run_dir)) <= 1e-6
