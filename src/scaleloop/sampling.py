"""Text from a trained language model: ``scaleloop sample RUN_DIR --prompt TEXT`` and
``scaleloop.sample(run_dir, prompt)``.

The model is rebuilt exactly as the run built it, from the run's own ``config.toml`` (the same
code as training: no size to guess), and its final weights are loaded from ``model.pt``
weights-only: a file in a run directory may have been handed over, and one holding pickled code
is refused in one line, never run.

Three kinds of model generate: the built-in ``TinyGPT`` and a user's model whose forward returns
the logits, or nanoGPT's pair ``(logits, loss)`` (token by token here, the context cropped to the
run's ``--seq-len`` as nanoGPT's ``generate`` crops to its block size); and a transformers causal
LM (``--model config.json``), through its own ``generate``.

Text becomes token ids and back through, in this order: a tokenizer directory (``--tokenizer``,
transformers' ``AutoTokenizer``, local files only); nanoGPT's ``meta.pkl`` in the run's data
directory (``itos``/``stoi``, read without running code); else the ids themselves (the prompt is
then ids separated by spaces, and so is the output).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from scaleloop.checkpoint.weights import TORCH_FILE, load_weights, read_torch_file
from scaleloop.config import TrainConfig, load_toml, resolve
from scaleloop.data.settings import MODEL_NAMES
from scaleloop.data.tokenfile import META_PICKLE, read_meta_pickle
from scaleloop.errors import UsageError
from scaleloop.hfconfig import positions
from scaleloop.loop.build import build_data_and_model
from scaleloop.loop.losses import prediction_of

__all__ = ["sample", "Codec", "generate_ids"]

CONFIG_FILE = "config.toml"
#: The built-in models that are not language models: refused before the run's data is read.
NOT_LANGUAGE_MODELS = tuple(name for name in MODEL_NAMES if name != "tinygpt")


@dataclass(frozen=True)
class Codec:
    """How a prompt becomes token ids and generated ids become text (``what`` says which way)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    what: str
    size: Optional[int] = None   # the ids it can decode: 0..size-1 (None: all the model's)


def run_config(run_dir: Path) -> TrainConfig:
    """The settings ``run_dir`` trained with; UsageError (one line) when it is no finished run."""
    if not run_dir.is_dir():
        raise UsageError(f"no run directory {str(run_dir)!r}: give the --out of a finished scaleloop train run")
    if not (run_dir / CONFIG_FILE).is_file():
        raise UsageError(f"{str(run_dir)!r} has no {CONFIG_FILE}: not a run directory (the --out of a scaleloop "
                         "train run)")
    if not (run_dir / TORCH_FILE).is_file():
        raise UsageError(f"{str(run_dir)!r} has no {TORCH_FILE}: the run has not finished (scaleloop doctor "
                         f"{run_dir} says what happened to it)")
    return resolve(load_toml(run_dir / CONFIG_FILE), {})


def _meta_codec(cfg: TrainConfig) -> Optional[Codec]:
    """nanoGPT's ``meta.pkl`` in a token-file run's data directory, as a codec; None without one."""
    if not cfg.model_data.data.startswith("tokenfile") or not cfg.model_data.data_dir:
        return None
    directory = Path(cfg.model_data.data_dir)
    meta = read_meta_pickle(directory)
    stoi, itos = meta.get("stoi"), meta.get("itos")
    if stoi is None and itos is None:
        return None
    where = str(directory / META_PICKLE)
    if isinstance(itos, list):   # some preparations keep itos as a list
        itos = dict(enumerate(itos))
    if (not isinstance(stoi, dict) or not isinstance(itos, dict)
            or not all(isinstance(k, str) and isinstance(v, int) for k, v in stoi.items())
            or not all(isinstance(k, int) and isinstance(v, str) for k, v in itos.items())):
        raise UsageError(f"{where!r}: 'stoi' must map strings to ids and 'itos' ids to strings, as nanoGPT's "
                         "prepare.py writes them")

    def encode(text: str) -> list[int]:
        missing = sorted({ch for ch in text if ch not in stoi})
        if missing:
            shown = ", ".join(repr(ch) for ch in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                                                  else "")
            raise UsageError(f"--prompt: {shown} {'is' if len(missing) == 1 else 'are'} not in the vocabulary of "
                             f"{where!r} ({len(stoi)} characters): use only characters of the training text")
        return [stoi[ch] for ch in text]

    def decode(ids: Sequence[int]) -> str:
        return "".join(itos.get(i, f"<{i}>") for i in ids)

    return Codec(encode, decode, f"characters of {where}", size=max(itos, default=-1) + 1)


def _tokenizer_codec(directory: str) -> Codec:
    """A transformers tokenizer saved in ``directory`` (never downloaded), as a codec."""
    if not Path(directory).is_dir():
        raise UsageError(f"--tokenizer {directory!r} is not a directory (a tokenizer saved with save_pretrained)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError("--tokenizer needs transformers installed (pip install transformers)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise UsageError(f"--tokenizer {directory!r}: no tokenizer could be read from it ({detail})") from None
    return Codec(lambda text: list(tokenizer(text)["input_ids"]),
                 lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), f"the tokenizer in {directory}")


def _id_codec() -> Codec:
    """No vocabulary to read: token ids in, token ids out, separated by spaces."""

    def encode(text: str) -> list[int]:
        try:
            return [int(part) for part in text.split()]
        except ValueError:
            raise UsageError(f"--prompt {text[:40]!r}: this run has no vocabulary to encode text with (no meta.pkl "
                             "in its --data-dir, and no --tokenizer DIR): give token ids separated by spaces, "
                             "e.g. --prompt '1 2 3'") from None

    return Codec(encode, lambda ids: " ".join(str(i) for i in ids), "token ids")


def codec_for(cfg: TrainConfig, tokenizer: Optional[str]) -> Codec:
    """The codec of a run (the module docstring's order)."""
    if tokenizer is not None:
        return _tokenizer_codec(tokenizer)
    return _meta_codec(cfg) or _id_codec()


def _build(cfg: TrainConfig, run_dir: Path) -> tuple[nn.Module, int, int]:
    """The run's model with its final weights, in evaluation mode; its vocabulary and context."""
    if cfg.model_data.model.lower() in NOT_LANGUAGE_MODELS or cfg.model_data.task not in ("auto", "lm"):
        what = f"--model {cfg.model_data.model}" if cfg.model_data.model.lower() in NOT_LANGUAGE_MODELS else f"--task {cfg.model_data.task}"
        raise UsageError(f"{str(run_dir)!r} is not a language model run ({what}): scaleloop sample needs a model "
                         "trained on token data (--model tinygpt, a config.json or a factory, with --data tokenfile)")
    data, model = build_data_and_model(cfg)
    if data.info.task != "lm" or data.info.num_classes is None:
        raise UsageError(f"{str(run_dir)!r} is not a language model run (dataset {data.info.name!r} is a "
                         f"{data.info.task} task): scaleloop sample needs a model trained on token data")
    load_weights(model, read_torch_file(run_dir / TORCH_FILE), str(run_dir / TORCH_FILE))
    return model.eval(), data.info.num_classes, data.info.input_shape[0]


def _pick(logits: torch.Tensor, temperature: float, top_k: Optional[int]) -> torch.Tensor:
    """The next token of each row: the likeliest at temperature 0, else drawn from the softmax of
    ``logits / temperature`` over the ``top_k`` likeliest (all of them without ``top_k``)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)


@torch.no_grad()
def generate_ids(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: Optional[int] = None, context: Optional[int] = None,
                 vocab: Optional[int] = None) -> torch.Tensor:
    """``ids`` ``(samples, prompt)`` continued by ``max_new_tokens`` tokens, one forward a token.

    ``model(ids)`` returns the logits ``(samples, seq, vocab)`` or a tuple that starts with them
    (nanoGPT's ``(logits, loss)``, whose logits may be the last position's alone); only the last
    position is used. ``context``: the longest input the model takes (the run's ``--seq-len``);
    a longer sequence is cropped to its last ``context`` tokens. ``vocab``: only ids below it
    are drawn (those the codec can write)."""
    for _ in range(max_new_tokens):
        window = ids if context is None else ids[:, -context:]
        logits = prediction_of(model(window))[:, -1, :].float()
        if vocab is not None and vocab < logits.shape[-1]:
            logits[:, vocab:] = float("-inf")
        ids = torch.cat([ids, _pick(logits, temperature, top_k)], dim=1)
    return ids


def _is_transformers(model: nn.Module) -> bool:
    return callable(getattr(model, "generate", None)) and hasattr(model, "generation_config")


@torch.no_grad()
def _hf_generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                 top_k: Optional[int], vocab: Optional[int]) -> list[list[int]]:
    """A transformers causal LM's own ``generate``, each sample cut at its end-of-text token.
    ``vocab``: only ids below it are drawn (as :func:`generate_ids`)."""
    longest = positions(model.config)
    if longest is not None and ids.shape[1] + max_new_tokens > longest:
        raise UsageError(f"the prompt's {ids.shape[1]} tokens and --max-new-tokens {max_new_tokens} exceed the "
                         f"model's {longest} positions: give --max-new-tokens {max(longest - ids.shape[1], 0)} or "
                         "less, or a shorter prompt")
    model.config.use_cache = True   # training turned the KV cache off (hfconfig.build_causal_lm)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    options: dict[str, Any] = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens,
                                   pad_token_id=min(eos_ids) if eos_ids else 0)
    if temperature > 0:
        # top_k 0 turns off the 50 a generation config has by default: without --top-k, all tokens.
        options.update(temperature=temperature, top_k=top_k or 0, top_p=1.0)
    width = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None
    if vocab is not None and width is not None and vocab < width:
        options["suppress_tokens"] = list(range(vocab, width))   # ids the codec could not write
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    rows = []
    for row in out.tolist():
        new = row[ids.shape[1]:]
        end = next((i for i, token in enumerate(new) if token in eos_ids), None)
        rows.append(row[:ids.shape[1]] + (new if end is None else new[:end]))
    return rows


def _check(prompt: str, max_new_tokens: int, temperature: float, top_k: Optional[int], num_samples: int) -> None:
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if not temperature >= 0:
        raise UsageError(f"--temperature must be zero (the likeliest token) or positive, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top-k must be a positive integer, got {top_k}")
    if num_samples < 1:
        raise UsageError(f"--num-samples must be a positive integer, got {num_samples}")
    if not prompt:
        raise UsageError("--prompt is empty: give the text (or token ids) the samples start from")


def sample(run_dir: str | Path, prompt: str, *, max_new_tokens: int = 200, temperature: float = 1.0,
           top_k: Optional[int] = None, seed: int = 0, num_samples: int = 1, tokenizer: Optional[str] = None,
           device: str = "cpu") -> list[str]:
    """``num_samples`` continuations of ``prompt`` by the model a finished run trained, each the
    prompt and ``max_new_tokens`` new tokens as text (the module docstring: which model, which
    codec). The same ``seed`` gives the same samples; the caller's random number generators are
    left as they were. UsageError (one line) for a missing run, a run that is not a language
    model, a prompt the vocabulary cannot encode, or a bad number."""
    _check(prompt, max_new_tokens, temperature, top_k, num_samples)
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    codec = codec_for(cfg, tokenizer)
    target = torch.device(device)
    states = random.getstate(), np.random.get_state()
    try:
        # build_data_and_model seeds every generator, as training does; sampling then draws from
        # ``seed``. fork_rng puts torch's back afterwards, the lines around it Python's and numpy's.
        with torch.random.fork_rng(devices=[target] if target.type == "cuda" else []):
            model, vocab, context = _build(cfg, run_dir)
            ids = codec.encode(prompt)
            if not ids:
                raise UsageError(f"--prompt {prompt!r} encodes to no token ({codec.what})")
            if max(ids) >= vocab or min(ids) < 0:
                bad = next(i for i in ids if i >= vocab or i < 0)
                raise UsageError(f"--prompt gives token id {bad} ({codec.what}), outside the model's vocabulary "
                                 f"of {vocab} (ids 0..{vocab - 1})")
            model = model.to(target)
            batch = torch.tensor([ids] * num_samples, dtype=torch.long, device=target)
            torch.manual_seed(seed)
            if _is_transformers(model):
                rows = _hf_generate(model, batch, max_new_tokens, temperature, top_k, codec.size)
            else:
                rows = generate_ids(model, batch, max_new_tokens, temperature=temperature, top_k=top_k,
                                    context=context, vocab=codec.size).tolist()
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    return [codec.decode(row) for row in rows]
