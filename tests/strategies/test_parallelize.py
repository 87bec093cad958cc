"""The parallelism (``Parallelism``): built once from the settings, it gives every strategy its layout, its data
rank and its class, and ``parallelize`` applies its steps in one fixed order.

Multi-process runs of each composition (pp x dp, fsdp x tp, HSDP, ...) against one process are
in tests/distributed/test_mesh_dist.py and test_pipeline.py.
"""
from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.models import TinyGPT
from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.mesh import MeshSpec
import scaleloop
from scaleloop.strategies.factory import class_for
from scaleloop.strategies.parallelize import Parallelism, parallelize
from scaleloop.strategies.registry import ParallelSettings


@pytest.fixture(autouse=True)
def no_group_left() -> Iterator[None]:
    yield
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


@pytest.mark.parametrize("settings, world_size, spec, cls", [
    (ParallelSettings(strategy="ddp"), 4, MeshSpec(dp=4), "ddp"),
    (ParallelSettings(strategy="auto"), 1, MeshSpec(dp=1), "single"),
    (ParallelSettings(strategy="fsdp"), 4, MeshSpec(fsdp=4), "fsdp"),
    (ParallelSettings(strategy="pipeline"), 4, MeshSpec(pp=4), "pipeline"),
    (ParallelSettings(mesh="pp=2,dp=2"), 4, MeshSpec(pp=2, dp=2), "pipeline"),
    (ParallelSettings(mesh="fsdp=2,tp=2"), 4, MeshSpec(fsdp=2, tp=2), "mesh"),
    (ParallelSettings(strategy="mesh", mesh="dp=2,fsdp=2"), 4, MeshSpec(dp=2, fsdp=2), "mesh"),
])
def test_one_plan_gives_the_layout_and_the_class(settings: ParallelSettings, world_size: int, spec: MeshSpec,
                                                 cls: str) -> None:
    parallelism = Parallelism.of(settings, world_size, rank=0)
    assert parallelism.spec == spec
    assert class_for(settings, parallelism, distributed=world_size > 1) == cls


def test_the_data_rank_and_world_follow_the_mesh() -> None:
    settings = ParallelSettings(mesh="pp=2,dp=2")
    ranks = [Parallelism.of(settings, 4, rank) for rank in range(4)]
    # rank p*R + d: stage p of replica d; the stages of a replica share its batch
    assert [p.data_rank for p in ranks] == [0, 1, 0, 1]
    assert {p.data_world for p in ranks} == {2}
    assert [p.coordinates["pp"] for p in ranks] == [0, 0, 1, 1]
    tp = [Parallelism.of(ParallelSettings(mesh="fsdp=2,tp=2"), 4, r) for r in range(4)]
    assert [p.data_rank for p in tp] == [0, 0, 1, 1]   # the tp ranks of a group load the same samples


def test_steps_are_named_in_their_fixed_order() -> None:
    parallelism = Parallelism(MeshSpec(dp=2, fsdp=2, tp=2), recompute=True)
    assert parallelism.steps() == ["tensor parallel over tp=2", "activation checkpointing",
                                   "data parallel over dp=2 x fsdp=2"]
    assert Parallelism(MeshSpec(pp=2, dp=2)).steps() == ["data parallel over dp=2", "pipeline split over pp=2"]
    assert Parallelism(MeshSpec(dp=1)).steps() == []


class Recorder:
    """A strategy's steps, recorded (what ``parallelize`` calls, in which order, with which module)."""

    def __init__(self, parallelism: Parallelism) -> None:
        self.parallelism = parallelism
        self.calls: list[str] = []

    def _tensor_parallel(self, model: nn.Module) -> None:
        self.calls.append("tp")

    def _data_parallel(self, model: nn.Module) -> nn.Module:
        self.calls.append(f"data (blocks checkpointed: {self.parallelism.recomputed_blocks})")
        return nn.Sequential(model)

    def _pipeline_split(self, model: nn.Module) -> nn.Module:
        self.calls.append(f"pipeline ({type(model).__name__})")
        return model


def test_parallelize_applies_tp_then_recompute_then_data_then_the_split() -> None:
    model = TinyGPT(vocab_size=16, seq_len=8, d_model=16, n_layers=2, n_heads=2)
    strategy = Recorder(Parallelism(MeshSpec(), recompute=True))
    out = parallelize(model, strategy)
    # the blocks are checkpointed after TP and before the data step; the split gets the data step's module
    assert strategy.calls == ["tp", "data (blocks checkpointed: 2)", "pipeline (Sequential)"]
    assert isinstance(out, nn.Sequential)
    off = Recorder(Parallelism(MeshSpec()))
    parallelize(model, off)
    assert off.calls[1] == "data (blocks checkpointed: 0)"


def test_every_strategy_reads_its_layout_from_its_parallelism() -> None:
    env = DistEnv()
    for name, spec in (("single", MeshSpec(dp=1)), ("fsdp", MeshSpec(fsdp=1)), ("mesh", MeshSpec(tp=1))):
        strategy = scaleloop.strategy(name, env, mesh="tp=1" if name == "mesh" else None, activation_checkpointing=True)
        assert strategy.layout == strategy.parallelism.spec == spec
        assert strategy.parallelism.recompute
        model, _ = strategy.setup(TinyGPT(vocab_size=16, seq_len=8, d_model=16, n_layers=2, n_heads=2),
                                  lambda p: torch.optim.SGD(p, lr=0.1))
        assert strategy.parallelism.recomputed_blocks == 2
        strategy.close()


def test_the_header_names_the_steps_in_their_order() -> None:
    from scaleloop.strategies.parallelize import order_line

    parallelism = Parallelism(MeshSpec(fsdp=2, tp=2), recompute=True)
    assert order_line(parallelism) == ["applied in this order: tensor parallel over tp=2, then activation "
                                       "checkpointing, then data parallel over fsdp=2"]
    assert order_line(Parallelism(MeshSpec(fsdp=4))) == []   # one step: the strategy's name says it
