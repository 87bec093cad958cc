"""MNIST IDX reading, against small synthetic IDX files written by the tests themselves."""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from scaleloop.data.datasets import build_datasets
from scaleloop.data.mnist import (MNIST_FILES, TEST_IMAGES, TEST_LABELS, TRAIN_IMAGES,
                                  TRAIN_LABELS, load_mnist)
from scaleloop.errors import UsageError

N_TRAIN, N_TEST = 20, 7


def write_idx(path: Path, array: np.ndarray, *, magic: int | None = None, gz: bool = False,
              cut: int = 0) -> Path:
    """Write ``array`` (uint8) as an IDX file; ``magic`` overrides the header, ``cut`` drops
    that many trailing bytes to simulate a truncated file."""
    if magic is None:
        magic = 0x00000800 | array.ndim
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    if cut:
        payload = payload[:-cut]
    if gz:
        path = path.with_name(path.name + ".gz")
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wb") as fh:
            fh.write(payload)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
    return path


def make_arrays(rows: int = 28, cols: int = 28, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        TRAIN_IMAGES: rng.integers(0, 256, (N_TRAIN, rows, cols), dtype=np.uint8),
        TRAIN_LABELS: rng.integers(0, 10, (N_TRAIN,), dtype=np.uint8),
        TEST_IMAGES: rng.integers(0, 256, (N_TEST, rows, cols), dtype=np.uint8),
        TEST_LABELS: rng.integers(0, 10, (N_TEST,), dtype=np.uint8),
    }


def write_mnist(folder: Path, arrays: dict[str, np.ndarray], gz: bool = False) -> None:
    for name, array in arrays.items():
        write_idx(folder / name, array, gz=gz)


def check_loaded(data, arrays: dict[str, np.ndarray]) -> None:
    rows, cols = arrays[TRAIN_IMAGES].shape[1:]
    assert data.info.name == "mnist"
    assert data.info.task == "classification"
    assert data.info.num_classes == 10
    assert data.info.input_shape == (1, rows, cols)
    for ds, images, labels in ((data.train, TRAIN_IMAGES, TRAIN_LABELS),
                               (data.test, TEST_IMAGES, TEST_LABELS)):
        x, y = ds.tensors
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.device.type == "cpu"
        assert x.shape == (len(arrays[images]), 1, rows, cols)
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
        expected = torch.from_numpy(arrays[images].astype(np.float32) / 255.0).unsqueeze(1)
        torch.testing.assert_close(x, expected)
        assert torch.equal(y, torch.from_numpy(arrays[labels].astype(np.int64)))


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize("sub", [(), ("raw",), ("MNIST", "raw")], ids=["flat", "raw", "tv"])
def test_loads_plain_gz_and_torchvision_layouts(tmp_path: Path, gz: bool, sub: tuple) -> None:
    arrays = make_arrays()
    write_mnist(tmp_path.joinpath(*sub), arrays, gz=gz)
    check_loaded(load_mnist(str(tmp_path)), arrays)


def test_mixed_plain_and_gz_files(tmp_path: Path) -> None:
    arrays = make_arrays(seed=3)
    for i, (name, array) in enumerate(arrays.items()):
        write_idx(tmp_path / name, array, gz=bool(i % 2))
    check_loaded(load_mnist(tmp_path), arrays)


def test_image_size_comes_from_header(tmp_path: Path) -> None:
    arrays = make_arrays(rows=5, cols=6)
    write_mnist(tmp_path, arrays)
    data = load_mnist(str(tmp_path))
    assert data.info.input_shape == (1, 5, 6)
    check_loaded(data, arrays)


def test_build_datasets_mnist_uses_data_dir(tmp_path: Path) -> None:
    arrays = make_arrays(seed=1)
    write_mnist(tmp_path, arrays, gz=True)
    check_loaded(build_datasets("mnist", data_dir=str(tmp_path)), arrays)


def error_of(data_dir: Path | str) -> str:
    with pytest.raises(UsageError) as info:
        load_mnist(str(data_dir))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    message = error_of(missing)
    assert "does not exist" in message and str(missing) in message


def test_data_dir_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    assert "not a directory" in error_of(path)


def test_missing_files_are_named(tmp_path: Path) -> None:
    arrays = make_arrays()
    write_idx(tmp_path / TRAIN_IMAGES, arrays[TRAIN_IMAGES])
    write_idx(tmp_path / TEST_LABELS, arrays[TEST_LABELS], gz=True)
    message = error_of(tmp_path)
    assert TRAIN_LABELS in message and TEST_IMAGES in message
    assert TRAIN_IMAGES not in message and TEST_LABELS not in message
    assert "scaleloop never downloads; put the four MNIST IDX files there" in message


def test_empty_directory_names_all_four(tmp_path: Path) -> None:
    message = error_of(tmp_path)
    assert all(name in message for name in MNIST_FILES)


@pytest.mark.parametrize("name", [TRAIN_IMAGES, TEST_LABELS])
def test_bad_magic_number(tmp_path: Path, name: str) -> None:
    arrays = make_arrays()
    write_mnist(tmp_path, arrays)
    # Swap in the other kind's magic: a labels header on images, or vice versa.
    wrong = 0x00000801 if "images" in name else 0x00000803
    write_idx(tmp_path / name, arrays[name], magic=wrong)
    message = error_of(tmp_path)
    assert "magic number" in message and name in message


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_truncated_data(tmp_path: Path, gz: bool) -> None:
    arrays = make_arrays()
    write_mnist(tmp_path, arrays)
    (tmp_path / TRAIN_IMAGES).unlink()
    write_idx(tmp_path / TRAIN_IMAGES, arrays[TRAIN_IMAGES], cut=100, gz=gz)
    message = error_of(tmp_path)
    assert "truncated" in message and TRAIN_IMAGES in message


def test_truncated_header(tmp_path: Path) -> None:
    arrays = make_arrays()
    write_mnist(tmp_path, arrays)
    (tmp_path / TEST_IMAGES).write_bytes((0x00000803).to_bytes(4, "big") + b"\x00\x00")
    message = error_of(tmp_path)
    assert "truncated" in message and TEST_IMAGES in message


def test_extra_trailing_bytes(tmp_path: Path) -> None:
    arrays = make_arrays()
    write_mnist(tmp_path, arrays)
    with open(tmp_path / TEST_LABELS, "ab") as fh:
        fh.write(b"\x01\x02")
    message = error_of(tmp_path)
    assert "longer than its header says" in message and TEST_LABELS in message


def test_corrupt_gzip(tmp_path: Path) -> None:
    arrays = make_arrays()
    write_mnist(tmp_path, arrays)
    (tmp_path / TRAIN_LABELS).unlink()
    (tmp_path / f"{TRAIN_LABELS}.gz").write_bytes(b"this is not gzip data")
    message = error_of(tmp_path)
    assert "cannot read" in message and TRAIN_LABELS in message


def test_image_label_count_mismatch(tmp_path: Path) -> None:
    arrays = make_arrays()
    arrays[TEST_LABELS] = arrays[TEST_LABELS][:-2]
    write_mnist(tmp_path, arrays)
    message = error_of(tmp_path)
    assert f"{N_TEST} images" in message and f"{N_TEST - 2} labels" in message
    assert TEST_IMAGES in message and TEST_LABELS in message


def test_label_out_of_range(tmp_path: Path) -> None:
    arrays = make_arrays()
    arrays[TRAIN_LABELS][3] = 12
    write_mnist(tmp_path, arrays)
    message = error_of(tmp_path)
    assert "12" in message and TRAIN_LABELS in message


def test_train_and_test_sizes_must_agree(tmp_path: Path) -> None:
    arrays = make_arrays()
    arrays[TEST_IMAGES] = np.zeros((N_TEST, 14, 14), dtype=np.uint8)
    write_mnist(tmp_path, arrays)
    message = error_of(tmp_path)
    assert "28x28" in message and "14x14" in message
