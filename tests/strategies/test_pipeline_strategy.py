"""The pipeline strategy's pieces that need no process group: the cut into stages and the checks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scaleloop.config import TrainConfig
from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError
from scaleloop.models import build_model
from scaleloop.strategies.pipeline import _balanced_cuts, pipeline_layers, cut_stages

DIGITS = DataInfo(name="digits", task="classification", input_shape=(1, 8, 8), num_classes=10)
TOKENS = DataInfo(name="tokens", task="lm", input_shape=(16,), num_classes=64)


@pytest.mark.parametrize("name, info, x", [
    ("simplenet", DIGITS, torch.randn(5, 1, 8, 8)),
    ("biggernet", DIGITS, torch.randn(5, 1, 8, 8)),
    ("convnet", DIGITS, torch.randn(5, 1, 8, 8)),
    ("tinygpt", TOKENS, torch.randint(0, 64, (5, 16))),
])
def test_every_built_in_model_flattens_to_the_same_computation(name: str, info: DataInfo, x: torch.Tensor) -> None:
    torch.manual_seed(0)
    model = build_model(name, info).eval()
    layers = pipeline_layers(model)
    out = x
    for layer in layers:
        out = layer(out)
    assert torch.equal(out, model(x))
    # the layers share the model's parameters (no copies)
    ids = {id(p) for layer in layers for p in layer.parameters()}
    assert ids == {id(p) for p in model.parameters()}


def test_stages_balance_parameters_and_keep_parameter_free_layers_with_the_layer_before() -> None:
    model = build_model("biggernet", DIGITS, hidden_dim=64)
    assignment = cut_stages(pipeline_layers(model), 2, "BiggerNet")
    # Flatten, Linear(64,64), ReLU | Linear(64,64), ReLU, Linear(64,10)
    assert assignment.layers == (range(0, 3), range(3, 6))
    assert sum(assignment.parameters) == sum(p.numel() for p in model.parameters())
    assert assignment.names[0] == ("Flatten", "Linear", "ReLU")
    assert "stage 1: layers 3-5 (Linear, ReLU, Linear)" in "\n".join(assignment.describe())


def test_balanced_cuts_minimise_the_largest_stage() -> None:
    assert _balanced_cuts([10, 1, 1, 10], 2) == [0, 2, 4]
    assert _balanced_cuts([1, 1, 1, 10], 2) == [0, 3, 4]
    assert _balanced_cuts([5, 5, 5], 3) == [0, 1, 2, 3]


def test_a_model_too_shallow_for_the_stages_is_refused() -> None:
    model = build_model("simplenet", DIGITS)
    with pytest.raises(UsageError, match="2 layer\\(s\\) with parameters, so it cannot be cut into 3 pipeline stages"):
        cut_stages(pipeline_layers(model), 3, "SimpleNet")


def test_a_model_without_a_layer_order_is_refused_with_what_to_do() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(x)

    with pytest.raises(UsageError, match="as_sequential\\(\\) method"):
        pipeline_layers(Branchy())


@pytest.mark.parametrize("changes, says", [
    (dict(nproc=1), "add --nproc 2"),
    (dict(nproc=4, microbatches=2, pipeline_schedule="1f1b"), "use --microbatches 4 or more, or gpipe"),
    (dict(nproc=2, stages_per_rank=2), "needs --pipeline-schedule interleaved"),
    (dict(nproc=2, sync_batchnorm=True), "drop it"),
    (dict(nproc=2, batch_size=8, microbatches=16), "fewer than --microbatches 16"),
    (dict(nproc=2, batch_size=30, accumulate=4), "use a multiple of 4"),
])
def test_config_refuses_pipelines_that_cannot_work(changes: dict, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        TrainConfig(strategy="pipeline", **changes).validate()


def test_microbatches_belong_to_the_pipeline() -> None:
    with pytest.raises(UsageError, match="applies to --strategy pipeline \\(or --mesh pp=N\\) only"):
        TrainConfig(strategy="ddp", nproc=2, microbatches=4).validate()
    with pytest.raises(UsageError, match="--pipeline-schedule applies to --strategy pipeline only"):
        TrainConfig(strategy="ddp", nproc=2, pipeline_schedule="1f1b").validate()
    with pytest.raises(UsageError, match="--sharded-checkpoints applies to pipelines"):
        TrainConfig(strategy="ddp", nproc=2, sharded_checkpoints=True).validate()
    # fp16 runs under the pipeline (one overflow check over the stages)
    assert TrainConfig(strategy="pipeline", nproc=2, precision="fp16").validate()
    # the global batch is not divided among a pipeline's ranks: 30 is fine for 2 stages
    assert TrainConfig(strategy="pipeline", nproc=2, batch_size=30, microbatches=3).validate()
