"""``--mesh``: parsing, checking against the world size, the rank layout and its picture, and the
tensor-parallel plan of TinyGPT (no process group needed; the runs: tests/distributed/test_mesh_dist.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from torch import nn

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.models import TinyGPT
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.strategies.tensor import strided_tp_supported, tp_plan_of


def test_parse_names_aliases_and_sizes() -> None:
    spec = MeshSpec.parse("dp=2, tp=2")
    assert (spec.dp, spec.fsdp, spec.tp, spec.pp) == (2, 1, 2, 1)
    assert MeshSpec.parse("shard=4") == MeshSpec(fsdp=4)
    assert MeshSpec.parse("replicate=2,FSDP=2") == MeshSpec(dp=2, fsdp=2)
    assert spec.world_size == 4 and spec.data_parallel == 2 and str(spec) == "dp=2,tp=2"


@pytest.mark.parametrize("text, says", [
    ("dp=2,tp", "is not NAME=SIZE"), ("dp=2,xy=2", "unknown dimension 'xy'"), ("tp=0", "positive integer"),
    ("dp=2,dp=2", "given twice"), ("", "NAME=SIZE pairs"), ("dp=2,,tp=2", "NAME=SIZE pairs"),
    ("tp=two", "is not NAME=SIZE")])
def test_bad_shapes_are_one_line_errors(text: str, says: str) -> None:
    with pytest.raises(UsageError, match=says) as info:
        MeshSpec.parse(text)
    assert "\n" not in str(info.value)


def test_the_mesh_must_have_the_world_size() -> None:
    MeshSpec.parse("dp=2,tp=2").check(4)
    with pytest.raises(UsageError, match="has 4 ranks, but the job has 2 processes"):
        MeshSpec.parse("dp=2,tp=2").check(2)


def test_ranks_are_row_major_with_tp_innermost() -> None:
    spec = MeshSpec(dp=2, fsdp=2, tp=2)
    assert spec.coordinates(5) == {"pp": 0, "dp": 1, "fsdp": 0, "tp": 1}
    # tp ranks share their batch share; dp x fsdp ranks each get their own.
    assert [spec.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_picture_says_which_rank_holds_what() -> None:
    lines = MeshSpec.parse("dp=2,tp=2").draw()
    assert lines[0].startswith("mesh dp=2 x tp=2 (4 ranks")
    assert "tp=0" in lines[1] and "tp=1" in lines[1]
    assert lines[2].split() == ["dp=0", "r0", "r1"] and lines[3].split() == ["dp=1", "r2", "r3"]
    assert "rank 3: batch share 1 of 2" in lines[7] and "tensor slice 1 of 2" in lines[7]
    assert "replica 1 of 2" in lines[7]


def test_config_checks_the_mesh_and_splits_the_batch_over_data_ranks() -> None:
    TrainConfig(mesh="dp=2,tp=2", nproc=4, batch_size=2).validate()   # 2 data ranks: 1 sample each
    with pytest.raises(UsageError, match="does not split|split"):
        TrainConfig(mesh="dp=2,tp=2", nproc=4, batch_size=3).validate()
    with pytest.raises(UsageError, match="drop --strategy ddp"):
        TrainConfig(mesh="dp=2,tp=2", nproc=4, strategy="ddp").validate()
    with pytest.raises(UsageError, match="needs the layout"):
        TrainConfig(strategy="mesh", nproc=4).validate()


def test_config_takes_find_unused_parameters_with_a_mesh_without_pp() -> None:
    # Issue 41.11: it was refused for every --mesh ("do not apply to --mesh").
    TrainConfig(mesh="dp=2", nproc=2, find_unused_parameters=True).validate()
    TrainConfig(mesh="dp=2,tp=2", nproc=4, find_unused_parameters=True).validate()
    with pytest.raises(UsageError, match="--mesh pp=2,dp=2 runs as a pipeline, whose stages train parameters without"):
        TrainConfig(mesh="pp=2,dp=2", nproc=4, find_unused_parameters=True).validate()
    with pytest.raises(UsageError, match="--static-graph is an option of DistributedDataParallel, which --mesh dp=2"):
        TrainConfig(mesh="dp=2", nproc=2, static_graph=True).validate()
    with pytest.raises(UsageError, match="use it with --strategy ddp \\(not fsdp\\)"):
        TrainConfig(strategy="fsdp", nproc=2, find_unused_parameters=True).validate()


def test_config_takes_pipeline_x_data_parallel() -> None:
    cfg = TrainConfig(mesh="pp=2,dp=2", nproc=4, batch_size=8, accumulate=2, microbatches=2,
                      pipeline_schedule="1f1b").validate()
    assert cfg.pipeline_layout() == (2, 2)   # 2 stage positions, each held by 2 replicas
    with pytest.raises(UsageError, match="fewer than --microbatches 4"):   # 8 / (2 replicas x 2) = 2 per micro-step
        TrainConfig(mesh="pp=2,dp=2", nproc=4, batch_size=8, accumulate=2, microbatches=4).validate()
    with pytest.raises(UsageError, match="pp composes with dp only"):
        TrainConfig(mesh="pp=2,tp=2", nproc=4).validate()
    with pytest.raises(UsageError, match="--microbatches 2 applies to --strategy pipeline"):
        TrainConfig(mesh="dp=2,tp=2", nproc=4, microbatches=2).validate()
    with pytest.raises(UsageError, match="--compile does not support --mesh pp=N"):
        TrainConfig(mesh="pp=2,dp=2", nproc=4, compile=True).validate()


def test_cli_reports_a_bad_mesh_in_one_line_with_exit_2() -> None:
    res = subprocess.run([sys.executable, "-m", "scaleloop", "train", "--mesh", "dp=2,tp=2", "--nproc", "2"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "scaleloop: error: --mesh dp=2,tp=2 has 4 ranks, but the job has 2 processes: make --nproc x --nnodes 4, "
        "or change the mesh"]


@pytest.mark.skipif(not strided_tp_supported(), reason="tp of a fused q/k/v needs torch 2.13+ (refused in one line: "
                                                        "test_a_fused_split_on_old_torch_is_one_line)")
def test_tinygpt_plan_splits_attention_and_mlp() -> None:
    model = TinyGPT(vocab_size=16, seq_len=8, d_model=32, n_layers=2, n_heads=4)
    plan = model.tp_plan(2)
    assert plan["blocks.1.attn.qkv"] == "colwise:3" and plan["blocks.1.attn.proj"] == "rowwise"
    assert plan["blocks.0.mlp.0"] == "colwise" and plan["blocks.0.mlp.2"] == "rowwise" and len(plan) == 8
    assert len(tp_plan_of(model, 2)) == 8   # every entry names a submodule and a known style


def test_a_fused_split_on_old_torch_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import scaleloop.strategies.tensor as tensor

    monkeypatch.setattr(tensor, "strided_tp_supported", lambda: False)
    with pytest.raises(UsageError, match="'colwise:3' .* needs torch 2.13 or newer"):
        tp_plan_of(TinyGPT(vocab_size=16, seq_len=8, d_model=32, n_heads=4), 2)


def test_heads_must_divide_by_tp() -> None:
    with pytest.raises(UsageError, match="4 attention heads do not divide by tp=3"):
        tp_plan_of(TinyGPT(vocab_size=16, seq_len=8, d_model=32, n_heads=4), 3)


def test_a_model_without_a_plan_gets_one_line() -> None:
    with pytest.raises(UsageError, match="Sequential has no tp_plan\\(\\) method") as info:
        tp_plan_of(nn.Sequential(nn.Linear(2, 2)), 2)
    assert "\n" not in str(info.value)


def test_a_plan_naming_no_submodule_is_refused() -> None:
    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def tp_plan(self, tp: int) -> dict[str, str]:
            return {"fc2": "colwise"}

    with pytest.raises(UsageError, match="'fc2' is not a submodule"):
        tp_plan_of(Wrong(), 2)
