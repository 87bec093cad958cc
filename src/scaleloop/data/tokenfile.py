"""Token files: a flat binary array of token ids (``train.bin``, and ``val.bin`` beside it, the
layout nanoGPT's data preparation writes with ``ndarray.tofile``), cut into language-model windows.

``--data tokenfile --data-dir DIR`` trains on random windows, ``--data tokenfile-seq`` on
sequential ones; both evaluate on ``val.bin``'s sequential windows when the file is there. A
window ``i`` of ``--seq-len`` L is ``x = tokens[s:s+L]``, ``y = tokens[s+1:s+L+1]``:

- sequential: ``s = i * L``, so the windows follow each other and cover the file in order
  (the dataset says ``in_order``: the training loop does not shuffle them);
- random: ``s`` is drawn uniformly from every start that fits, by a seeded hash of ``(seed, i)``
  (random windows with replacement, as nanoGPT samples them). Window ``i`` is fixed, so the
  sampler (``sampler.StepSampler``) gives every step the same windows on 1 or N ranks and
  after a resume, with no generator state to save; each epoch draws the same windows in a new order.

Both have ``(tokens - 1) // L`` windows, so an epoch reads about as many tokens as the file holds.

The file is read through ``np.memmap``, opened lazily in each process (and DataLoader worker)
that reads, never copied whole into memory; start-up reads one window. The token type is
``uint16`` unless ``DIR/meta.json`` says ``{"dtype": "uint32"}``; the vocabulary is
``--vocab-size``, or ``meta.json``'s ``"vocab_size"``, which wins.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from scaleloop.data.info import DataInfo, Datasets
from scaleloop.errors import UsageError

#: ``--data`` names: random windows, sequential windows.
TOKENFILE_NAMES = ("tokenfile", "tokenfile-seq")
TRAIN_FILE, VAL_FILE, META_FILE = "train.bin", "val.bin", "meta.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
Windows = Literal["random", "sequential"]

_MASK = (1 << 64) - 1


def _mix(seed: int, i: int) -> int:
    """A 64-bit hash of ``(seed, i)`` (the splitmix64 finaliser): the same on every platform."""
    z = (seed * 0x9E3779B97F4A7C15 + (i + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class TokenFileDataset(Dataset):
    """Language-model windows ``(x, y)`` of ``seq_len`` int64 tokens from a token file (module docstring).

    ``vocab_size`` and ``task`` are declared, so start-up never scans the file for them.
    """

    task = "lm"
    padded = False   # every target is a token (data.datasets.targets_padded: no -100 to look for)

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int, *, dtype: str = "uint16",
                 windows: Windows = "sequential", seed: int = 0) -> None:
        self.path = Path(path)
        self.seq_len, self.vocab_size, self.dtype, self.windows, self.seed = seq_len, vocab_size, dtype, windows, seed
        self.in_order = windows == "sequential"   # the loop keeps the file's order (no shuffle)
        self.n_tokens = _token_count(self.path, dtype)
        if self.n_tokens < seq_len + 1:
            raise UsageError(f"{str(self.path)!r} holds {self.n_tokens:,} {dtype} tokens, fewer than one window of "
                             f"--seq-len {seq_len} needs ({seq_len + 1}); give a smaller --seq-len")
        self._tokens: Optional[np.memmap] = None

    @property
    def tokens(self) -> np.memmap:
        """The file, mapped read-only (opened on first use, in the process that reads)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        return self._tokens

    def __getstate__(self) -> dict[str, Any]:
        # A DataLoader worker maps the file itself: the pickle carries the path, not the pages.
        return {**self.__dict__, "_tokens": None}

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def start(self, i: int) -> int:
        """Where window ``i`` starts in the file."""
        if self.windows == "sequential":
            return i * self.seq_len
        return _mix(self.seed, i) % (self.n_tokens - self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Windows ``indices`` read in one gather from the file (the DataLoader asks for a batch's
        windows at once): one copy and one check for the batch, rather than one per window."""
        n = len(self)
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"window {i} of {n}")
        starts = np.fromiter((self.start(int(i)) for i in indices), dtype=np.int64, count=len(indices))
        # Fancy indexing reads only these windows' pages of the map, into a new (small) array.
        windows = torch.from_numpy(np.asarray(self.tokens)[starts[:, None] + np.arange(self.seq_len + 1)]
                                   .astype(np.int64))
        # Start-up reads one window, so a token beyond the vocabulary shows here (a few ns a token),
        # named, rather than as an embedding's bare "index out of range".
        if windows.numel() and int(windows.max()) >= self.vocab_size:
            row = int((windows >= self.vocab_size).any(dim=1).nonzero()[0])
            high, i, s = int(windows[row].max()), indices[row], int(starts[row])
            raise UsageError(f"{str(self.path)!r} holds token {high} (window {i}, from token {s}), beyond the "
                             f"vocabulary of {self.vocab_size}: give --vocab-size (or {META_FILE}'s \"vocab_size\") "
                             "larger than every token id")
        return list(zip(windows[:, :-1].unbind(0), windows[:, 1:].unbind(0)))


def token_files(name: str, data_dir: Optional[str], seq_len: int, vocab_size: int, seed: int) -> Datasets:
    """``--data tokenfile`` / ``tokenfile-seq``: the training windows of ``DIR/train.bin`` and the
    sequential test windows of ``DIR/val.bin`` (no test set without it). Reads one window."""
    directory = check_token_dir(name, data_dir)
    dtype, vocab_size = _meta(directory, vocab_size)
    windows: Windows = "random" if name == "tokenfile" else "sequential"
    train = TokenFileDataset(directory / TRAIN_FILE, seq_len, vocab_size, dtype=dtype, windows=windows, seed=seed)
    val = directory / VAL_FILE
    test = TokenFileDataset(val, seq_len, vocab_size, dtype=dtype) if val.is_file() else None
    train[0]   # one window: a token beyond the vocabulary fails here, before the model is built
    return Datasets(train, test, DataInfo(name, "lm", (seq_len,), vocab_size))


def check_token_dir(name: str, data_dir: Optional[str]) -> Path:
    """The directory of ``--data-dir`` holding ``train.bin``; a UsageError naming what is missing."""
    if not data_dir:
        raise UsageError(f"dataset {name!r} reads {TRAIN_FILE} (and {VAL_FILE}) from a directory: pass --data-dir DIR")
    directory = Path(data_dir)
    if not (directory / TRAIN_FILE).is_file():
        what = "does not exist" if not directory.exists() else f"holds no {TRAIN_FILE}"
        raise UsageError(f"--data-dir {data_dir!r} {what}; --data {name} reads token ids from DIR/{TRAIN_FILE} "
                         f"(and DIR/{VAL_FILE}), as written by ndarray.tofile")
    return directory


def _meta(directory: Path, vocab_size: int) -> tuple[str, int]:
    """The token type and vocabulary size: ``meta.json``'s, else uint16 and ``vocab_size``."""
    path = directory / META_FILE
    if not path.is_file():
        return "uint16", vocab_size
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{str(path)!r} cannot be read as JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{str(path)!r} must hold a JSON object such as {{\"dtype\": \"uint16\", \"vocab_size\": 50304}}")
    dtype = meta.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise UsageError(f"{str(path)!r}: \"dtype\" {dtype!r} is not a token type; use one of {', '.join(DTYPES)}")
    size = meta.get("vocab_size", vocab_size)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise UsageError(f"{str(path)!r}: \"vocab_size\" must be a positive integer, got {size!r}")
    return dtype, size


def _token_count(path: Path, dtype: str) -> int:
    """Tokens in ``path`` from its size alone; a size that is no whole number of tokens is an error."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise UsageError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    if size % itemsize:
        raise UsageError(f"{str(path)!r} is {size:,} bytes, not a whole number of {dtype} tokens ({itemsize} bytes "
                         f"each): is it a token file, and is its type {dtype}? ({META_FILE}'s \"dtype\" says)")
    return size // itemsize
