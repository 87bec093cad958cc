"""A causal language model from a transformers config (``--model path/to/config.json``, or a
directory holding one): its structure, randomly initialised, never downloaded.

``scaleloop train`` builds it for real (random weights: a config has none), ``scaleloop plan``
under ``torch.device("meta")`` (shapes only). Both build it here, the same way, so that what is
planned is what trains. Only causal language models (the classes transformers'
``AutoModelForCausalLM`` makes: ``LlamaForCausalLM``, ``GPT2LMHeadModel``...) are built from a
config: their task is scaleloop's ``lm`` (next token over ``--data tokens`` or a token file).
Anything else (a classifier, an encoder) is refused in one line; a factory
(``package.module:factory``) builds it.

The path checks import neither torch nor transformers (the launcher's preflight runs them).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from scaleloop.errors import UsageError

if TYPE_CHECKING:
    from torch import nn


def is_config_path(name: str) -> bool:
    """Whether ``--model name`` names a transformers config: a ``.json`` file or a directory
    (a built-in model's name stays the built-in, even where a directory of that name exists)."""
    from scaleloop.data.settings import MODEL_NAMES

    return name.endswith(".json") or (Path(name).is_dir() and name.lower() not in MODEL_NAMES)


def config_file(name: str) -> Path:
    """The config.json ``name`` names; UsageError (one line) when there is none."""
    path = Path(name)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"--model {name}: no such config.json")
    return file


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_config(name: str) -> Any:
    """The transformers config of ``name``, read from the local file only (no download)."""
    file = config_file(name)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise UsageError("--model CONFIG.json needs transformers installed (pip install transformers)") from None
    try:
        return AutoConfig.from_pretrained(str(file), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:   # bad JSON, no or unknown model_type
        raise UsageError(f"--model {name}: not a transformers config ({_first_line(exc)})") from None


def _causal_classes() -> set[str]:
    """The class names ``AutoModelForCausalLM`` makes, whichever model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def positions(config: Any) -> Optional[int]:
    """The longest sequence the config declares (``max_position_embeddings``; GPT-2's ``n_positions``)."""
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def build_causal_lm(name: str, seq_len: Optional[int] = None, vocab_size: Optional[int] = None) -> "nn.Module":
    """The causal LM of config ``name`` in fp32 on the current default device, for training:
    random weights, no KV cache. ``seq_len`` and ``vocab_size``: the data's, checked against the
    config (a token past its vocabulary or a position past its table would fail inside the forward)."""
    import torch

    config = load_config(name)
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures and not set(architectures) & _causal_classes():
        raise UsageError(f"--model {name}: {', '.join(architectures)} is not a causal language model; a config.json "
                         "builds a causal LM only (e.g. LlamaForCausalLM, GPT2LMHeadModel): for another model give "
                         "package.module:factory")
    longest = positions(config)
    if seq_len is not None and longest is not None and seq_len > longest:
        raise UsageError(f"--seq-len {seq_len} is longer than the config's max_position_embeddings {longest}: "
                         f"give --seq-len {longest} or less, or raise it in {config_file(name)}")
    if vocab_size is not None and vocab_size > config.vocab_size:
        raise UsageError(f"the data has token ids up to {vocab_size - 1} and {name} a vocabulary of "
                         f"{config.vocab_size}: give --vocab-size {config.vocab_size} (or less)")
    # Training keeps no KV cache: left on (a config's default), every layer's keys and values
    # stay alive to the end of the forward, and activation checkpointing's recompute appends to it.
    config.use_cache = False
    from transformers import AutoModelForCausalLM

    try:
        # fp32 parameters whatever the config's torch_dtype (a checkpoint's storage type):
        # scaleloop keeps fp32 masters and casts for --precision itself.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as exc:   # a model type without a causal LM (and no architectures to say so)
        raise UsageError(f"--model {name}: transformers builds no causal language model from it "
                         f"({_first_line(exc)}); for another model give package.module:factory") from None
    model.train()
    return model


def save_causal_lm(name: str, state_dict: dict[str, Any], directory: Path) -> None:
    """Write the causal LM of config ``name`` with ``state_dict``'s weights (the full weights, on
    the CPU) as transformers' ``save_pretrained`` does: ``config.json`` and safetensors, which
    ``AutoModelForCausalLM.from_pretrained(directory)`` loads. The model is built on the meta
    device only to carry the config and its tied-weight rules: the weights written are
    ``state_dict``'s, so no second copy is made, whatever strategy trained them."""
    import torch

    config = load_config(name)
    # Training turned the KV cache off (build_causal_lm); whoever loads this generates with it.
    config.use_cache = True
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Its "Writing model shards" bar would be the last line of a run's output: not ours to show.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # (safetensors is save_pretrained's default format since transformers 4.35.)
        model.save_pretrained(str(directory), state_dict=dict(state_dict))
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
