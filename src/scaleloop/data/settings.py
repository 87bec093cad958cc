"""The config's model-and-data section: what is trained on (and the model's sizes), how batches are
loaded, and its checks. Each field is declared once, here, with its help (``scaleloop.option``)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple, Optional

from scaleloop.errors import UsageError
from scaleloop.option import flag, option, require

TASKS = ("auto", "classification", "binary", "regression", "lm")

_model_data = partial(option, group="model and data")
_hardware = partial(option, group="hardware")
_speed = partial(option, group="speed")

# The built-in datasets and models, by name (here, without torch, for the launcher's checks).
DATASET_NAMES: tuple[str, ...] = ("digits", "random", "mnist", "images", "tokens", "tokenfile", "tokenfile-seq")
MODEL_NAMES: tuple[str, ...] = ("simplenet", "biggernet", "convnet", "tinygpt")


class TinyGPTSizes(NamedTuple):
    """TinyGPT's shape: ``--d-model``, ``--n-layers`` and ``--n-heads`` (the defaults: train's TinyGPT)."""

    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4


#: ``--model tinygpt`` without size flags (and every run saved before they existed).
TINYGPT_DEFAULTS = TinyGPTSizes()


def tinygpt_sizes(model: str, d_model: Optional[int] = None, n_layers: Optional[int] = None,
                  n_heads: Optional[int] = None) -> TinyGPTSizes:
    """The sizes of ``--model tinygpt``, each the one given or its default; UsageError (one line) for a
    size that is not positive, a width the heads do not divide, or sizes given for another model."""
    given = {name: value for name, value in (("d_model", d_model), ("n_layers", n_layers), ("n_heads", n_heads))
             if value is not None}
    if given and model.lower() != "tinygpt":
        flags = " ".join(f"{flag(name)} {value}" for name, value in given.items())
        one = len(given) == 1
        raise UsageError(f"{flags} {'sizes' if one else 'size'} the built-in --model tinygpt only, not --model "
                         f"{model}: drop {'it' if one else 'them'}, or use --model tinygpt")
    for name, value in given.items():
        require(value >= 1, name, "a positive integer")
    sizes = TINYGPT_DEFAULTS._replace(**given)
    if sizes.d_model % sizes.n_heads:
        raise UsageError(f"--d-model {sizes.d_model} must be divisible by --n-heads {sizes.n_heads} (each head takes "
                         f"d_model / n_heads of the width): give a multiple of {sizes.n_heads} or another --n-heads")
    return sizes


@dataclass(frozen=True)
class DataSettings:
    """The dataset and model names, generated data's sizes, the user's loss and metrics, loading."""

    model: str = _model_data("simplenet", "model: simplenet, biggernet, convnet, tinygpt, or package.module:factory",
                             common=True)
    data: str = _model_data("digits", "dataset: digits, random, mnist, images, tokens, tokenfile (random windows of "
                            "DIR/train.bin), tokenfile-seq (sequential windows), or package.module:factory",
                            common=True)
    data_dir: Optional[str] = _model_data(None, "directory holding the MNIST IDX files (--data mnist; never "
                                          "downloads), or train.bin and val.bin (--data tokenfile)")
    init_from: Optional[str] = _model_data(None, "start from these weights instead of random ones: a .safetensors "
                                           "file, a transformers directory (config.json and model.safetensors) or a "
                                           "run directory (its model.safetensors, else model.pt); their names and "
                                           "shapes must be the model's. A run resumed from a checkpoint continues "
                                           "from the checkpoint instead")
    hidden_dim: int = _model_data(128, "hidden width of simplenet/biggernet", common=True)
    d_model: Optional[int] = _model_data(None, f"tinygpt: width of the token vectors, divisible by --n-heads "
                                         f"(default: {TINYGPT_DEFAULTS.d_model})")
    n_layers: Optional[int] = _model_data(None, f"tinygpt: transformer blocks (default: {TINYGPT_DEFAULTS.n_layers})")
    n_heads: Optional[int] = _model_data(None, f"tinygpt: attention heads (default: {TINYGPT_DEFAULTS.n_heads})")
    n_samples: int = _model_data(10_000, "training samples for generated datasets (random, images, tokens)")
    input_dim: int = _model_data(20, "features per sample for --data random")
    image_size: int = _model_data(32, "side of the square images for --data images")
    seq_len: int = _model_data(64, "tokens per sample for --data tokens and tokenfile")
    vocab_size: int = _model_data(256, "vocabulary size for --data tokens and tokenfile (DIR/meta.json's "
                                  "vocab_size wins)")
    test_fraction: float = _model_data(0.2, "share held out as the test set (digits, generated datasets)")
    task: str = _model_data("auto", "what the target is: auto (from the first sample), classification, binary, "
                            "regression (mean squared error) or lm", TASKS)
    loss: Optional[str] = _model_data(None, "your loss, package.module:fn, fn(prediction, target) -> the mean loss "
                                      "over the batch (default: the model's own loss if it returns one, else the "
                                      "task's)")
    metrics: Optional[str] = _model_data(None, "your evaluation metrics, package.module:fn[,...], fn(prediction, "
                                         "target) -> one value per sample (or the batch mean); reported over the "
                                         "whole test set")
    num_workers: int = _hardware(0, "DataLoader worker processes (only for datasets that are not in-memory tensors)")
    channels_last: bool = _speed(False, "channels-last memory format for the model's 4-d weights and its 4-d inputs "
                                 "(convolutions: faster on recent GPUs); a model without 4-d weights is left as it is")
    pin_memory: bool = _speed(True, "on CUDA: gather batches in page-locked host memory and copy them with "
                              "non_blocking=True, so the host does not wait for the GPU at every batch")
    persistent_workers: bool = _speed(False, "keep the DataLoader's worker processes alive between epochs "
                                      "(needs --num-workers 1 or more)")
    data_on_device: bool = _speed(False, "copy the whole in-memory training set to the device once and gather every "
                                  "batch there, with no copy per step (it must fit in device memory)")

    def check(self) -> None:
        for name in ("hidden_dim", "n_samples", "input_dim", "image_size", "seq_len", "vocab_size"):
            require(getattr(self, name) >= 1, name, "a positive integer")
        require(0 <= self.test_fraction < 1, "test_fraction", "in [0, 1)")
        tinygpt_sizes(self.model, self.d_model, self.n_layers, self.n_heads)
        require(self.num_workers >= 0, "num_workers", "zero or positive")
        for name in ("loss", "metrics"):
            for spec in (getattr(self, name) or "").split(","):
                if getattr(self, name) is not None and ":" not in spec:
                    raise UsageError(f"{flag(name)} {spec.strip()!r}: expected 'package.module:function'")
        if self.persistent_workers and self.num_workers == 0:
            raise UsageError("--persistent-workers keeps DataLoader worker processes between epochs, and "
                             "--num-workers is 0 (no workers): add --num-workers N, or drop it")
