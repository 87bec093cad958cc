"""The config's model-and-data section: what is trained on (and the model's sizes), how batches are
loaded, and its checks. Each field is declared once, here, with its help (``scaleloop.option``)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

from scaleloop.errors import UsageError
from scaleloop.option import flag, option, require

TASKS = ("auto", "classification", "binary", "regression", "lm")

_model_data = partial(option, group="model and data")
_hardware = partial(option, group="hardware")
_speed = partial(option, group="speed")

# The built-in datasets and models, by name (here, without torch, for the launcher's checks).
DATASET_NAMES: tuple[str, ...] = ("digits", "random", "mnist", "images", "tokens", "tokenfile", "tokenfile-seq")
MODEL_NAMES: tuple[str, ...] = ("simplenet", "biggernet", "convnet", "tinygpt")


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
        require(self.num_workers >= 0, "num_workers", "zero or positive")
        for name in ("loss", "metrics"):
            for spec in (getattr(self, name) or "").split(","):
                if getattr(self, name) is not None and ":" not in spec:
                    raise UsageError(f"{flag(name)} {spec.strip()!r}: expected 'package.module:function'")
        if self.persistent_workers and self.num_workers == 0:
            raise UsageError("--persistent-workers keeps DataLoader worker processes between epochs, and "
                             "--num-workers is 0 (no workers): add --num-workers N, or drop it")
