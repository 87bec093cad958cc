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
``uint16`` unless ``DIR/meta.json`` says ``{"dtype": "uint32"}``.

The vocabulary is declared by ``DIR/meta.json``'s ``"vocab_size"`` or by ``DIR/meta.pkl``'s
``vocab_size`` (the file nanoGPT's ``prepare.py`` writes, with ``itos``/``stoi`` for decoding:
read without running code, as plain dicts, numbers and strings only). Without ``--vocab-size``
the file's is used; a larger ``--vocab-size`` is used with a note (room for more tokens than the
file's); a smaller one is refused: the file's tokens would not fit.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from scaleloop.data.info import DataInfo, Datasets
from scaleloop.errors import UsageError

#: ``--data`` names: random windows, sequential windows.
TOKENFILE_NAMES = ("tokenfile", "tokenfile-seq")
TRAIN_FILE, VAL_FILE, META_FILE, META_PICKLE = "train.bin", "val.bin", "meta.json", "meta.pkl"
#: ``--vocab-size``'s default (config/sections.py; a test checks they agree): a value the user did not choose.
DEFAULT_VOCAB = 256
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
                             f"vocabulary of {self.vocab_size}: give --vocab-size (or {META_FILE}'s or {META_PICKLE}'s \"vocab_size\") "
                             "larger than every token id")
        return list(zip(windows[:, :-1].unbind(0), windows[:, 1:].unbind(0)))


def token_files(name: str, data_dir: Optional[str], seq_len: int, vocab_size: int, seed: int) -> Datasets:
    """``--data tokenfile`` / ``tokenfile-seq``: the training windows of ``DIR/train.bin`` and the
    sequential test windows of ``DIR/val.bin`` (no test set without it). Reads one window."""
    directory = check_token_dir(name, data_dir)
    dtype, declared = _meta(directory)
    vocab_size, notes = _vocabulary(directory, vocab_size, declared)
    windows: Windows = "random" if name == "tokenfile" else "sequential"
    train = TokenFileDataset(directory / TRAIN_FILE, seq_len, vocab_size, dtype=dtype, windows=windows, seed=seed)
    val = directory / VAL_FILE
    test = TokenFileDataset(val, seq_len, vocab_size, dtype=dtype) if val.is_file() else None
    train[0]   # one window: a token beyond the vocabulary fails here, before the model is built
    return Datasets(train, test, DataInfo(name, "lm", (seq_len,), vocab_size), notes)


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


def _meta(directory: Path) -> tuple[str, Optional[tuple[int, Path]]]:
    """The token type (``meta.json``'s, else uint16) and the vocabulary size the directory declares,
    with the file that declares it (None: neither ``meta.json`` nor ``meta.pkl`` says)."""
    path = directory / META_FILE
    meta: dict[str, Any] = {}
    if path.is_file():
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{str(path)!r} cannot be read as JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise UsageError(f"{str(path)!r} must hold a JSON object such as {{\"dtype\": \"uint16\", \"vocab_size\": 50304}}")
    dtype = meta.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise UsageError(f"{str(path)!r}: \"dtype\" {dtype!r} is not a token type; use one of {', '.join(DTYPES)}")
    sizes = {file: size for file, size in ((path, meta.get("vocab_size")),
                                           (directory / META_PICKLE, read_meta_pickle(directory).get("vocab_size")))
             if size is not None}
    for file, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UsageError(f"{str(file)!r}: \"vocab_size\" must be a positive integer, got {size!r}")
    if len(set(sizes.values())) > 1:
        raise UsageError(f"{' and '.join(repr(str(f)) for f in sizes)} declare different vocabularies "
                         f"({' and '.join(str(v) for v in sizes.values())}): remove or fix one")
    return dtype, next(((size, file) for file, size in sizes.items()), None)


def _vocabulary(directory: Path, asked: int, declared: Optional[tuple[int, Path]]) -> tuple[int, list[str]]:
    """The vocabulary to train with, from ``--vocab-size`` (``asked``) and the file's, with the
    note that says why when they differ (rules in the module docstring)."""
    if declared is None or declared[0] == asked:
        return asked, []
    size, file = declared
    if asked == DEFAULT_VOCAB:   # not a choice the user made: the data's vocabulary
        return size, [f"note: vocabulary of {size:,} tokens, as {str(file)!r} declares"]
    if asked > size:
        return asked, [f"note: --vocab-size {asked:,} is larger than the {size:,} that {str(file)!r} declares: "
                       f"the model gets {asked:,} outputs, {asked - size:,} of them for tokens the data never holds"]
    raise UsageError(f"--vocab-size {asked:,} is smaller than the vocabulary of {size:,} that {str(file)!r} "
                     f"declares: its tokens would not fit; drop --vocab-size, or give at least {size:,}")


class _PlainValues(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, numbers and strings only: a pickle that names any class or
    function (and so could run code) is refused before anything is called."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_meta_pickle(directory: Path) -> dict[str, Any]:
    """``DIR/meta.pkl`` as nanoGPT's ``prepare.py`` writes it (``vocab_size``, ``itos``, ``stoi``),
    read without running code; {} when there is none. UsageError (one line) for anything else."""
    path = directory / META_PICKLE
    if not path.is_file():
        return {}
    try:
        with open(path, "rb") as fh:
            meta = _PlainValues(fh).load()
    except pickle.UnpicklingError as exc:
        raise UsageError(f"refusing to read {str(path)!r}: {exc}; a meta.pkl holds only plain values "
                         "(vocab_size, itos, stoi), so this one was not written by nanoGPT's prepare.py "
                         "or was tampered with (nothing in it was run)") from None
    except Exception as exc:   # a truncated or garbled pickle
        raise UsageError(f"{str(path)!r} cannot be read as a pickle of plain values: "
                         f"{' '.join(str(exc).split())[:160]}") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{str(path)!r} must hold a dict such as {{'vocab_size': 65, 'itos': ..., 'stoi': ...}}")
    return meta


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
