"""Verify under the pipeline strategy, without processes: whole-model names and the sync report."""
from __future__ import annotations

import torch
from torch import nn

from scaleloop.strategies.pipeline import StageModule
from scaleloop.strategies.precision import Precision
from scaleloop.verify.recorder import whole_model_names
from scaleloop.verify.sync import format_sync


def test_a_stage_names_its_parameters_as_the_whole_model_does() -> None:
    # Two stages on this rank (the interleaved schedule): the model's layers 2-3 and 4.
    stage = StageModule([[nn.Linear(2, 3), nn.ReLU()], [nn.Linear(3, 1)]], Precision("fp32", torch.device("cpu")))
    stage.global_keys = {"chunks.0.layers.0.weight": ["net.2.weight", "head.weight"],
                         "chunks.0.layers.0.bias": ["net.2.bias"],
                         "chunks.1.layers.0.weight": ["net.4.weight"], "chunks.1.layers.0.bias": ["net.4.bias"]}
    assert whole_model_names(stage) == {"chunks.0.layers.0.weight": "net.2.weight",
                                        "chunks.0.layers.0.bias": "net.2.bias",
                                        "chunks.1.layers.0.weight": "net.4.weight",
                                        "chunks.1.layers.0.bias": "net.4.bias"}
    plain = nn.Sequential(nn.Linear(2, 2))
    assert whole_model_names(plain) == {"0.weight": "0.weight", "0.bias": "0.bias"}


def test_sync_report_says_a_pipeline_has_no_replicas() -> None:
    result = {"world_size": 2, "tensors": 0, "parameters": 0, "buffers": 0, "diverging": [], "stages": True,
              "model_tensors": 4}
    passed, lines = format_sync(result, 3)
    assert passed and "no replicas" in lines[0] and lines[1] == "  nothing to compare"
    result.update(tensors=2, parameters=2)
    passed, lines = format_sync(result, 3)
    assert passed and "2 are held by several stages (tied)" in lines[0] and "identical copy" in lines[1]
