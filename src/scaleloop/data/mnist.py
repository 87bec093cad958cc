"""Read MNIST from the four standard IDX files already on disk; never downloads anything."""
from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from scaleloop.data.info import DataInfo, Datasets
from scaleloop.errors import UsageError

TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"
MNIST_FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)

# Magic numbers: two zero bytes, 0x08 (unsigned byte data), then the number of dimensions.
IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801

# Besides the directory itself, torchvision's layouts, so an existing download can be reused.
SUBFOLDERS = ((), ("raw",), ("MNIST", "raw"))

NUM_CLASSES = 10

def load_mnist(data_dir: str | os.PathLike[str]) -> Datasets:
    """Load MNIST train and test sets from IDX files in ``data_dir``.

    Each of ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` may be plain or gzipped
    (``.gz``) and may sit in ``data_dir``, ``data_dir/raw`` or ``data_dir/MNIST/raw``.
    Images become float32 ``(n, 1, rows, cols)`` in ``[0, 1]``; labels int64.

    Raises ``UsageError`` (one line, naming the file or directory) when the directory or a
    file is missing, or a file is malformed, truncated or disagrees with its partner.
    """
    root = Path(data_dir).expanduser()
    if not root.exists():
        raise UsageError(f"--data-dir {str(data_dir)!r} does not exist; point it at the folder "
                         "holding the four MNIST IDX files")
    if not root.is_dir():
        raise UsageError(f"--data-dir {str(data_dir)!r} is not a directory")

    found = {name: _find(root, name) for name in MNIST_FILES}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise UsageError(
            f"MNIST files missing in {str(root)!r} (also looked in raw/ and MNIST/raw/, "
            f"plain or .gz): {', '.join(missing)}; scaleloop never downloads; "
            "put the four MNIST IDX files there"
        )

    paths: dict[str, Path] = {name: path for name, path in found.items() if path is not None}
    train = _pair(paths[TRAIN_IMAGES], paths[TRAIN_LABELS])
    test = _pair(paths[TEST_IMAGES], paths[TEST_LABELS])

    shape = tuple(train.tensors[0].shape[1:])
    if tuple(test.tensors[0].shape[1:]) != shape:
        raise UsageError(
            f"MNIST images in {str(root)!r}: train images are {shape[1]}x{shape[2]} but test "
            f"images are {test.tensors[0].shape[2]}x{test.tensors[0].shape[3]}; "
            "both must have the same size"
        )
    info = DataInfo(name="mnist", task="classification", input_shape=shape, num_classes=NUM_CLASSES)
    return Datasets(train=train, test=test, info=info)


def _find(root: Path, name: str) -> Path | None:
    """First existing ``name`` or ``name.gz`` across the accepted subfolders."""
    for sub in SUBFOLDERS:
        folder = root.joinpath(*sub)
        for candidate in (folder / name, folder / f"{name}.gz"):
            if candidate.is_file():
                return candidate
    return None


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        # gzip.BadGzipFile is an OSError; a cut-off .gz ends in EOFError.
        raise UsageError(f"cannot read MNIST file {str(path)!r}: {exc}") from None


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """Parse an unsigned-byte IDX file whose magic number must be ``magic``."""
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise UsageError(f"MNIST file {str(path)!r} is truncated: {len(raw)} bytes, no IDX header")
    found_magic = int.from_bytes(raw[:4], "big")
    if found_magic != magic:
        raise UsageError(
            f"MNIST file {str(path)!r} has magic number 0x{found_magic:08x}, expected "
            f"0x{magic:08x}; is it the right (uncompressed or .gz) IDX file?"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UsageError(f"MNIST file {str(path)!r} is truncated inside its IDX header")
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    expected = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != expected:
        kind = "truncated" if len(raw) - header < expected else "longer than its header says"
        raise UsageError(
            f"MNIST file {str(path)!r} is {kind}: header says {'x'.join(map(str, dims))} "
            f"= {expected} bytes of data, file has {len(raw) - header}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _pair(images_path: Path, labels_path: Path) -> TensorDataset:
    """Read an images/labels pair, check they agree, and convert to CPU tensors."""
    images = _read_idx(images_path, IMAGES_MAGIC)
    labels = _read_idx(labels_path, LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise UsageError(
            f"MNIST files disagree: {str(images_path)!r} has {images.shape[0]} images but "
            f"{str(labels_path)!r} has {labels.shape[0]} labels"
        )
    if labels.size and int(labels.max()) >= NUM_CLASSES:
        raise UsageError(
            f"MNIST file {str(labels_path)!r} holds label {int(labels.max())}; "
            f"MNIST labels must be 0..{NUM_CLASSES - 1}"
        )
    # astype copies, so the tensors own writable memory rather than the read-only bytes.
    x = torch.from_numpy(images.astype(np.float32) / np.float32(255.0)).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    return TensorDataset(x, y)
