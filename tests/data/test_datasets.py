"""Built-in datasets, their validation, and user dataset factories."""
from __future__ import annotations

import sys
import textwrap
from collections import Counter
from typing import Iterator

import pytest
import torch
from torch.utils.data import TensorDataset

from scaleloop.data.datasets import DATASET_NAMES, RandomDataset, build_datasets
from scaleloop.data.info import DataInfo, Datasets
from scaleloop.errors import UsageError

FACTORY_MODULE = "scaleloop_test_user_data"


@pytest.fixture(scope="module")
def digits() -> Datasets:
    # Once per module: every test reads the same split.
    return build_datasets("digits")


def rows(ds: TensorDataset) -> Counter:
    """Each sample as a hashable (pixels, label) key, to compare splits as multisets."""
    x, y = ds.tensors
    return Counter((bytes(xi.numpy().tobytes()), int(yi)) for xi, yi in zip(x, y))


# --- digits ---------------------------------------------------------------------------------

def test_digits_shapes_dtypes_and_info(digits: Datasets) -> None:
    assert DATASET_NAMES == ("digits", "random", "mnist", "images", "tokens", "tokenfile", "tokenfile-seq")
    assert digits.info == DataInfo("digits", "classification", (1, 8, 8), 10)
    for ds in (digits.train, digits.test):
        assert isinstance(ds, TensorDataset)
        x, y = ds.tensors
        assert x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape[1:] == (1, 8, 8) and y.shape == (len(x),)
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert float(digits.train.tensors[0].max()) == 1.0  # 16/16: really scaled, not clipped
    assert set(digits.train.tensors[1].tolist()) == set(range(10))


def test_digits_are_read_from_scikit_learns_file_as_load_digits_gives_them() -> None:
    """Read without importing sklearn (2 s of scipy at every start-up), with the same values."""
    import subprocess

    code = ("import sys; from scaleloop.data.datasets import build_datasets; build_datasets('digits'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    from sklearn.datasets import load_digits

    from scaleloop.data.datasets import _digits_arrays

    pixels, labels = _digits_arrays()
    bunch = load_digits()
    assert pixels.dtype == bunch.data.dtype and (pixels == bunch.data).all()
    assert (labels == bunch.target).all()


def test_digits_split_is_a_stratified_partition(digits: Datasets) -> None:
    n_train, n_test = len(digits.train), len(digits.test)
    assert n_train + n_test == 1797
    assert abs(n_test - 0.2 * 1797) <= 10
    full = build_datasets("digits", test_fraction=0.0)
    assert full.test is None and len(full.train) == 1797
    # Train and test together are exactly the whole dataset: nothing lost, nothing doubled.
    assert rows(digits.train) + rows(digits.test) == rows(full.train)
    test_counts = torch.bincount(digits.test.tensors[1], minlength=10)
    all_counts = torch.bincount(full.train.tensors[1], minlength=10)
    share = test_counts.float() / all_counts.float()
    assert torch.all((share - 0.2).abs() < 0.01), share


def test_digits_split_is_deterministic_per_seed(digits: Datasets) -> None:
    again = build_datasets("digits")
    assert torch.equal(again.test.tensors[0], digits.test.tensors[0])
    assert torch.equal(again.train.tensors[1], digits.train.tensors[1])
    other = build_datasets("digits", seed=1)
    assert not torch.equal(other.test.tensors[0], digits.test.tensors[0])
    half = build_datasets("digits", test_fraction=0.5)
    assert abs(len(half.test) - 1797 / 2) <= 10


# --- random ---------------------------------------------------------------------------------

def test_random_dataset_matches_tutorial_definition() -> None:
    ds = RandomDataset(50, 7, generator=torch.Generator().manual_seed(3))
    assert isinstance(ds, TensorDataset)
    assert ds.X.shape == (50, 7) and ds.X.dtype == torch.float32
    assert ds.y.shape == (50, 1) and ds.y.dtype == torch.float32
    assert torch.equal(ds.y, (ds.X.sum(dim=1, keepdim=True) > 0).float())
    assert ds.tensors[0] is ds.X and ds.tensors[1] is ds.y
    x0, y0 = ds[0]
    assert torch.equal(x0, ds.X[0]) and torch.equal(y0, ds.y[0])
    again = RandomDataset(50, 7, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.X, ds.X)


def test_random_builtin() -> None:
    data = build_datasets("random", n_samples=300, input_dim=5, test_fraction=0.1, seed=4)
    assert data.info == DataInfo("random", "binary", (5,), 1)
    assert isinstance(data.train, RandomDataset) and isinstance(data.test, RandomDataset)
    assert len(data.train) == 300 and len(data.test) == 30
    for ds in (data.train, data.test):
        assert torch.equal(ds.y, (ds.X.sum(dim=1, keepdim=True) > 0).float())
    # Train and test are different draws, not the same samples.
    assert not torch.equal(data.test.X, data.train.X[:30])
    assert 0.3 < float(data.train.y.mean()) < 0.7
    same = build_datasets("random", n_samples=300, input_dim=5, test_fraction=0.1, seed=4)
    assert torch.equal(same.train.X, data.train.X) and torch.equal(same.test.X, data.test.X)
    other = build_datasets("random", n_samples=300, input_dim=5, test_fraction=0.1, seed=5)
    assert not torch.equal(other.train.X, data.train.X)


def test_random_test_size_edges() -> None:
    assert len(build_datasets("random", n_samples=3, test_fraction=0.1).test) == 1
    assert build_datasets("random", n_samples=3, test_fraction=0).test is None


# --- images and tokens ----------------------------------------------------------------------

def test_images_shapes_determinism_and_learnability() -> None:
    data = build_datasets("images", n_samples=2000, image_size=4, num_classes=4, seed=1)
    assert data.info == DataInfo("images", "classification", (3, 4, 4), 4)
    x, y = data.train.tensors
    assert x.shape == (2000, 3, 4, 4) and x.dtype == torch.float32
    assert y.shape == (2000,) and y.dtype == torch.int64
    counts = torch.bincount(y, minlength=4)
    assert counts.min() > 2000 / 4 / 2, counts  # every class well represented
    assert len(data.test) == 400
    # Labels come from a fixed linear map, so class-mean templates must beat chance by far.
    means = torch.stack([x[y == c].reshape(-1, 48).mean(0) for c in range(4)])
    tx, ty = data.test.tensors
    accuracy = ((tx.reshape(-1, 48) @ means.T).argmax(1) == ty).float().mean()
    assert accuracy > 0.6, accuracy
    again = build_datasets("images", n_samples=2000, image_size=4, num_classes=4, seed=1)
    assert torch.equal(again.train.tensors[1], y) and torch.equal(again.test.tensors[0], tx)


def test_tokens_shapes_and_shift() -> None:
    data = build_datasets("tokens", n_samples=40, seq_len=12, vocab_size=30, seed=2)
    assert data.info == DataInfo("tokens", "lm", (12,), 30)
    assert len(data.test) == 8
    for ds in (data.train, data.test):
        x, y = ds.tensors
        assert x.dtype == torch.int64 and y.dtype == torch.int64
        assert x.shape == (len(ds), 12) and y.shape == (len(ds), 12)
        assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
        assert int(x.min()) >= 0 and int(max(x.max(), y.max())) < 30
    again = build_datasets("tokens", n_samples=40, seq_len=12, vocab_size=30, seed=2)
    assert torch.equal(again.train.tensors[0], data.train.tensors[0])
    other = build_datasets("tokens", n_samples=40, seq_len=12, vocab_size=30, seed=3)
    assert not torch.equal(other.train.tensors[0], data.train.tensors[0])


# --- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["n_samples", "input_dim", "image_size", "num_classes",
                                 "seq_len", "vocab_size"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_sizes_must_be_positive_integers(key: str, value: object) -> None:
    with pytest.raises(UsageError) as info:
        build_datasets("random", **{key: value})
    flag = "--" + key.replace("_", "-")
    assert str(info.value) == f"{flag} must be a positive integer, got {value!r}"


@pytest.mark.parametrize("value", [1.0, 1.5, -0.1])
def test_test_fraction_range(value: float) -> None:
    with pytest.raises(UsageError, match=r"--test-fraction must be in \[0, 1\)"):
        build_datasets("random", test_fraction=value)


def test_seed_must_be_non_negative() -> None:
    with pytest.raises(UsageError, match="--seed must be a non-negative integer, got -1"):
        build_datasets("random", seed=-1)


def test_unknown_name() -> None:
    with pytest.raises(UsageError) as info:
        build_datasets("cifar")
    assert str(info.value) == ("unknown dataset 'cifar'; choose one of digits, random, mnist, "
                               "images, tokens, tokenfile, tokenfile-seq, or give 'package.module:factory'")


def test_mnist_needs_data_dir() -> None:
    with pytest.raises(UsageError) as info:
        build_datasets("mnist")
    assert str(info.value) == ("dataset 'mnist' reads IDX files from a directory: "
                               "pass --data-dir DIR (it never downloads)")


# --- user factories -------------------------------------------------------------------------

FACTORIES = '''
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset
from scaleloop.data.info import DataInfo, Datasets

def full():
    ds = TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))
    return Datasets(ds, None, DataInfo("mine", "classification", (2,), 7))

def pair(opts):
    n, d = opts["n_samples"], opts["input_dim"]
    x = torch.randn(n, d)
    train = TensorDataset(x, torch.arange(n) % 3)
    test = TensorDataset(torch.randn(5, d), torch.tensor([0, 1, 4, 1, 0]))
    return train, test

def binary():
    x = torch.randn(10, 3, 2)
    return TensorDataset(x, (x.sum((1, 2)) > 0).float().unsqueeze(1))

def lm(opts):
    w = torch.randint(0, 9, (6, opts["seq_len"] + 1))
    return (TensorDataset(w[:, :-1], w[:, 1:]), None)

class Plain(Dataset):
    def __len__(self):
        return 5
    def __getitem__(self, i):
        return torch.full((3,), float(i)), i * 2

def generic():
    return Plain()

class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0

def number():
    return 42

def triple():
    return binary(), None, None

def empty():
    return TensorDataset(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long))

def scalar_float():
    return TensorDataset(torch.zeros(3, 2), torch.zeros(3))

def int_rows():
    return TensorDataset(torch.zeros(3, 2), torch.zeros(3, 4, dtype=torch.long))

def float_rows():
    return TensorDataset(torch.zeros(3, 2), torch.randn(3, 4))

def float_not_binary():
    return TensorDataset(torch.zeros(3, 2), torch.tensor([[0.0], [1.0], [0.5]]))

def negative():
    return TensorDataset(torch.zeros(3, 2), torch.tensor([0, -1, 2]))

def iterable():
    return Stream()

def mismatched():
    return binary(), TensorDataset(torch.zeros(2, 5), torch.zeros(2, 1))
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("userdata")
    (folder / f"{FACTORY_MODULE}.py").write_text(textwrap.dedent(FACTORIES))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        yield FACTORY_MODULE
    sys.modules.pop(FACTORY_MODULE, None)


def test_factory_returning_datasets_is_kept(factories: str) -> None:
    data = build_datasets(f"{factories}:full")
    assert data.info == DataInfo("mine", "classification", (2,), 7)
    assert data.test is None and len(data.train) == 4


def test_factory_tuple_gets_options_and_classification_info(factories: str) -> None:
    spec = f"{factories}:pair"
    data = build_datasets(spec, n_samples=12, input_dim=6)
    assert len(data.train) == 12 and data.train.tensors[0].shape == (12, 6)
    # Labels reach 2 in train and 4 in test: the head must cover both.
    assert data.info == DataInfo(spec, "classification", (6,), 5)


def test_factory_single_binary_dataset(factories: str) -> None:
    spec = f"{factories}:binary"
    data = build_datasets(spec)
    assert data.test is None
    assert data.info == DataInfo(spec, "binary", (3, 2), 1)


def test_factory_lm(factories: str) -> None:
    spec = f"{factories}:lm"
    data = build_datasets(spec, seq_len=5)
    assert data.test is None
    tokens = torch.cat(data.train.tensors)
    assert data.info == DataInfo(spec, "lm", (5,), int(tokens.max()) + 1)


def test_factory_generic_dataset_with_int_labels(factories: str) -> None:
    spec = f"{factories}:generic"
    data = build_datasets(spec)
    # One sample cannot tell the number of classes of a dataset without in-memory tensors.
    assert data.info == DataInfo(spec, "classification", (3,), None)


@pytest.mark.parametrize("factory, outputs", [("scalar_float", 1), ("float_rows", 4), ("float_not_binary", 1)])
def test_float_targets_other_than_binary_are_regression(factories: str, factory: str, outputs: int) -> None:
    spec = f"{factories}:{factory}"
    assert build_datasets(spec).info == DataInfo(spec, "regression", (2,), outputs)


@pytest.mark.parametrize("factory, expected", [
    ("number", "returned int"),
    ("triple", "returned tuple"),
    ("empty", "training set is empty"),
    ("int_rows", "cannot tell the task"),
    ("negative", "negative class index"),
    ("mismatched", "test samples have input shape [5]"),
    ("nonexistent", "has no attribute"),
])
def test_bad_factory_results(factories: str, factory: str, expected: str) -> None:
    with pytest.raises(UsageError) as info:
        build_datasets(f"{factories}:{factory}")
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_factory_spec_still_validates_options(factories: str) -> None:
    with pytest.raises(UsageError, match="--n-samples must be a positive integer"):
        build_datasets(f"{factories}:pair", n_samples=0)


def test_bad_factory_module_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="cannot import module"):
        build_datasets("scaleloop_no_such_module_xyz:make")


class _NumpySamples(torch.utils.data.Dataset):
    """Samples as numpy arrays and numpy integers, as many users' datasets hold them."""

    def __init__(self, n: int, seed: int) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, 8)).astype(np.float32)
        self.y = (self.x.sum(1) > 0).astype(np.int64)
        self.num_classes = 2  # what one sample cannot tell (scaleloop reads one at start-up)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def test_numpy_samples_are_accepted_as_tensors_are() -> None:
    from scaleloop.data.datasets import infer_info

    info = infer_info("numpy", _NumpySamples(64, 0), _NumpySamples(16, 1))
    assert (info.task, info.input_shape, info.num_classes) == ("classification", (8,), 2)  # declared


def test_a_run_trains_on_numpy_samples(tmp_path, monkeypatch) -> None:
    from scaleloop.config import TrainConfig
    from scaleloop.loop.training import train
    from scaleloop.runtime.dist import DistEnv

    monkeypatch.setitem(sys.modules, "tests_numpy", sys.modules[__name__])
    (tmp_path / "numpy_data.py").write_text(
        "import sys\n\ndef build():\n    S = sys.modules['tests_numpy']._NumpySamples\n    return S(128, 0), S(32, 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = TrainConfig(data="numpy_data:build", epochs=2, batch_size=32, out=str(tmp_path / "run"), progress=False,
                      device="cpu", tensorboard=False)
    result = train(cfg, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")), log=lambda _m: None)
    assert result.test is not None and result.test.accuracy > 0.8
