"""The profile of a Hugging Face model from a local config.json: counted on the meta device, as the
real model has them; no download, no weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scaleloop.errors import UsageError
from scaleloop.plan.profile import ModelSpec, profile_model

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 64}


def test_a_hugging_face_config_is_profiled_without_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    profile = profile_model(ModelSpec(model=str(path), seq_len=32))
    real = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**LLAMA))
    assert profile.parameters == sum(p.numel() for p in real.parameters())
    assert len(profile.block_parameters) == 2 and profile.hidden == 64 and profile.heads == 4
    assert profile.tp_parameters == 0                     # no tp_plan(): the planner offers no tp layout
    assert profile.series.peak > 0 and profile.series_checkpointed is not None


def test_a_missing_config_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such config.json"):
        profile_model(ModelSpec(model=str(tmp_path / "absent.json")))
