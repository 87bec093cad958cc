"""Built-in datasets, and user dataset factories given as ``package.module:factory``.

Every built-in returns ``TensorDataset``s of CPU tensors: the loader's in-memory fast path
gathers whole batches from ``.tensors`` with an index tensor instead of per-sample calls.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from scaleloop.data.batch import describe, first_sample, first_tensor, split, tensors_of
from scaleloop.data.info import DataInfo, Datasets
from scaleloop.errors import UsageError
from scaleloop.plugins import call_factory, is_factory_spec, resolve_factory

#: Target value that cross-entropy skips (PyTorch's and Hugging Face's convention for padding).
IGNORE_INDEX = -100

DATASET_NAMES = ("digits", "random", "mnist", "images", "tokens")

# What the factory of a stream returns when the task needs every label (docs/streaming.md).
_GIVE_INFO = ("return scaleloop.Datasets(train, test, scaleloop.DataInfo(name, '{task}', input_shape, num_classes)) "
              "from the factory")

# Token streams are built from a fixed vocabulary of short random "phrases", so that a
# language model can lower its loss by memorising them, while generation stays vectorised.
_PHRASE_COUNT = 64
_PHRASE_LEN = 8


class RandomDataset(TensorDataset):
    """The tutorial's toy binary task: Gaussian inputs, label = whether their sum is positive.

    ``X`` is ``(n_samples, input_dim)`` float32 drawn from ``generator`` (the global RNG when
    None); ``y = (X.sum(dim=1, keepdim=True) > 0).float()`` has shape ``(n_samples, 1)``.
    """

    def __init__(self, n_samples: int, input_dim: int,
                 generator: Optional[torch.Generator] = None) -> None:
        X = torch.randn(n_samples, input_dim, generator=generator)
        y = (X.sum(dim=1, keepdim=True) > 0).float()
        super().__init__(X, y)
        self.X = X
        self.y = y


def build_datasets(name: str, *, data_dir: str | None = None, n_samples: int = 10_000,
                   input_dim: int = 20, image_size: int = 32, num_classes: int = 10,
                   seq_len: int = 64, vocab_size: int = 256, test_fraction: float = 0.2,
                   seed: int = 0, task: str = "auto") -> Datasets:
    """Build the train/test datasets named ``name`` (see ``DATASET_NAMES``) or a user factory.

    Built-ins are deterministic for a given ``seed``. With ``test_fraction == 0`` there is no
    test set. A user factory ``pkg.module:factory`` is called with no arguments, or with one
    dict of the keyword options here; it may return a ``Datasets``, a ``(train, test)`` tuple
    (``test`` may be None) or a single ``Dataset``, and for the last two the ``DataInfo`` is
    inferred from the first training sample (``task`` as in ``infer_info``). Bad input raises ``UsageError``.
    """
    sizes = {"n_samples": n_samples, "input_dim": input_dim, "image_size": image_size,
             "num_classes": num_classes, "seq_len": seq_len, "vocab_size": vocab_size}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be a positive integer, got {value!r}")
    if (isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float))
            or not 0 <= test_fraction < 1):
        raise UsageError(f"--test-fraction must be in [0, 1), got {test_fraction!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, got {seed!r}")

    if is_factory_spec(name):
        options = dict(sizes, test_fraction=test_fraction, seed=seed, data_dir=data_dir)
        return _from_factory(name, options, task)
    n_test = max(1, int(n_samples * test_fraction)) if test_fraction > 0 else 0
    if name == "digits":
        return _digits(test_fraction, seed)
    if name == "random":
        gen = torch.Generator().manual_seed(seed)
        train = RandomDataset(n_samples, input_dim, generator=gen)
        test = RandomDataset(n_test, input_dim, generator=gen) if n_test else None
        return Datasets(train, test, DataInfo("random", "binary", (input_dim,), 1))
    if name == "mnist":
        if not data_dir:
            raise UsageError("dataset 'mnist' reads IDX files from a directory: "
                             "pass --data-dir DIR (it never downloads)")
        from scaleloop.data.mnist import load_mnist
        return load_mnist(data_dir)
    if name == "images":
        return _images(n_samples, n_test, image_size, num_classes, seed)
    if name == "tokens":
        return _tokens(n_samples, n_test, seq_len, vocab_size, seed)
    raise UsageError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}, "
                     "or give 'package.module:factory'")


def _digits(test_fraction: float, seed: int) -> Datasets:
    """scikit-learn's bundled 8x8 digits with a stratified, seeded held-out split."""
    pixels, target = _digits_arrays()
    x = torch.from_numpy((pixels / 16.0).astype(np.float32)).reshape(-1, 1, 8, 8)
    labels = np.asarray(target, dtype=np.int64)
    y = torch.from_numpy(labels)
    info = DataInfo("digits", "classification", (1, 8, 8), 10)
    if test_fraction == 0:
        return Datasets(TensorDataset(x, y), None, info)
    # Per-class shuffles keep each digit's share the same in both splits.
    rng = np.random.default_rng(seed)
    test_parts = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        k = min(len(members) - 1, max(1, round(len(members) * test_fraction)))
        test_parts.append(members[:k])
    is_test = np.zeros(len(labels), dtype=bool)
    is_test[np.concatenate(test_parts)] = True
    train_idx = torch.from_numpy(np.flatnonzero(~is_test))
    test_idx = torch.from_numpy(np.flatnonzero(is_test))
    return Datasets(TensorDataset(x[train_idx], y[train_idx]),
                    TensorDataset(x[test_idx], y[test_idx]), info)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' pixels (float64, 1797 x 64) and labels, read from the file scikit-learn ships.

    Read directly: importing ``sklearn.datasets`` (scipy and all) takes about 2 s, as long as a
    short run's training, for one 1797-row CSV file. The values are those ``load_digits`` gives.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")   # finds the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in locations:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            table = np.loadtxt(path, delimiter=",")
            return table[:, :-1], table[:, -1].astype(int)
    from sklearn.datasets import load_digits  # a scikit-learn that keeps the file elsewhere

    bunch = load_digits()
    return bunch.data, bunch.target


def _images(n_train: int, n_test: int, size: int, num_classes: int, seed: int) -> Datasets:
    """Gaussian images labelled by the argmax of a fixed random linear map (learnable)."""
    gen = torch.Generator().manual_seed(seed)
    features = 3 * size * size
    weight = torch.randn(features, num_classes, generator=gen)
    # Equal-norm columns make every class equally likely, so accuracy is not skewed.
    weight /= weight.norm(dim=0, keepdim=True)

    def draw(n: int) -> TensorDataset:
        x = torch.randn(n, 3, size, size, generator=gen)
        return TensorDataset(x, (x.reshape(n, features) @ weight).argmax(dim=1))

    train = draw(n_train)
    test = draw(n_test) if n_test else None
    return Datasets(train, test, DataInfo("images", "classification", (3, size, size),
                                          num_classes))


def _tokens(n_train: int, n_test: int, seq_len: int, vocab_size: int, seed: int) -> Datasets:
    """Windows of a token stream made of repeated random phrases; y is x shifted by one."""
    gen = torch.Generator().manual_seed(seed)
    phrases = torch.randint(0, vocab_size, (_PHRASE_COUNT, _PHRASE_LEN), generator=gen)

    def draw(n: int) -> TensorDataset:
        window = seq_len + 1
        n_phrases = -(-n * window // _PHRASE_LEN)  # ceil: enough phrases to fill n windows
        picks = torch.randint(0, _PHRASE_COUNT, (n_phrases,), generator=gen)
        stream = phrases[picks].reshape(-1)[: n * window]
        w = stream.reshape(n, window)
        return TensorDataset(w[:, :-1].contiguous(), w[:, 1:].contiguous())

    train = draw(n_train)
    test = draw(n_test) if n_test else None
    return Datasets(train, test, DataInfo("tokens", "lm", (seq_len,), vocab_size))


def _from_factory(spec: str, options: dict[str, Any], task: str = "auto") -> Datasets:
    """Call a user factory and normalise what it returns into ``Datasets``."""
    result = call_factory(resolve_factory(spec, "data"), options)
    if isinstance(result, Datasets):
        return result
    if isinstance(result, (tuple, list)) and len(result) == 2:
        train, test = result
    elif isinstance(result, Dataset):
        train, test = result, None
    else:
        raise UsageError(
            f"--data {spec!r}: the factory returned {type(result).__name__}; expected a "
            "scaleloop Datasets, a (train, test) tuple, or a single torch Dataset"
        )
    for role, ds in (("train", train), ("test", test)):
        sized = isinstance(ds, Dataset) and hasattr(ds, "__len__")
        if ds is not None and not (sized or isinstance(ds, IterableDataset)):
            raise UsageError(f"--data {spec!r}: the {role} set is a {type(ds).__name__}, expected a torch "
                             "Dataset with __len__ or a stream (an IterableDataset, docs/streaming.md)")
    if not isinstance(train, IterableDataset) and len(train) == 0:
        raise UsageError(f"--data {spec!r}: the training set is empty")
    return Datasets(train, test, infer_info(spec, train, test, task=task))


def infer_info(name: str, train: Dataset, test: Optional[Dataset] = None, task: str = "auto") -> DataInfo:
    """Guess a ``DataInfo`` from the first sample of ``train``, cut into inputs and target by
    ``scaleloop.data.batch.split``; ``task`` (not ``auto``) says the task instead of guessing it.

    A float target of shape ``(1,)`` holding only 0 and 1 means binary; any other float target
    means regression (``num_classes`` = values per sample); an integer scalar means classification
    (``num_classes`` = largest label + 1); an integer 1-d target shaped like an integer 1-d input
    means a language model (``num_classes`` = largest token + 1). A mapping sample without a
    target (the model computes its own loss) gives the task ``none``. A stream (``IterableDataset``)
    is read for its first sample only: a task that needs every label (the number of classes; binary
    or regression for a float target of shape ``(1,)``) must then be given (``--task``, or the
    factory's ``DataInfo``).
    """
    try:
        sample = first_sample(train)
    except IndexError:
        raise UsageError(f"--data {name!r}: the training set is empty") from None
    inputs, target = split_sample(name, sample)
    x, y = _as_tensor(first_tensor(inputs) if not isinstance(inputs, (int, float)) else inputs), target
    if x is None:
        raise UsageError(f"--data {name!r}: the sample's inputs must be tensors, arrays or numbers, got {describe(inputs)}")
    shape = tuple(x.shape)
    if y is None:
        info = DataInfo(name, "none", shape, 0)
    else:
        y = _as_tensor(y)
        if y is None:
            raise UsageError(f"--data {name!r}: the target must be a tensor, an array or a number, got "
                             f"{describe(target)}")
        info = _task_of(name, x, y, train, test, task)
    if test is not None and (isinstance(test, IterableDataset) or len(test) > 0):
        try:
            test_x = first_tensor(split_sample(name, first_sample(test))[0])
        except IndexError:   # an empty stream
            return info
        if test_x is None or tuple(test_x.shape) != shape:
            raise UsageError(f"--data {name!r}: test samples have input shape "
                             f"{None if test_x is None else list(test_x.shape)}, "
                             f"but training samples have {list(shape)}")
    return info


def split_sample(name: str, sample: Any) -> tuple[Any, Any]:
    """``split`` with the error naming the dataset."""
    try:
        return split(sample)
    except UsageError as exc:
        raise UsageError(f"--data {name!r}: {exc}") from None


def _task_of(name: str, x: torch.Tensor, y: torch.Tensor, train: Dataset, test: Optional[Dataset],
             task: str) -> DataInfo:
    shape = tuple(x.shape)
    if task == "auto":
        if y.is_floating_point():
            if tuple(y.shape) == (1,):
                _scan(name, train, test, "telling binary from regression", "say --task binary or --task regression")
            task = "binary" if tuple(y.shape) == (1,) and _only_zero_one(train, test) else "regression"
        elif _is_int(y) and y.dim() == 0:
            task = "classification"
        elif _is_int(y) and _is_int(x) and y.dim() == 1 and y.shape == x.shape:
            task = "lm"
        else:
            raise UsageError(
                f"--data {name!r}: cannot tell the task from the first sample (input {list(x.shape)} "
                f"{x.dtype}, target {list(y.shape)} {y.dtype}); expected a float target (regression, or "
                "binary when it is [1] of 0/1), an integer class index (classification), or an int64 tensor "
                "shaped like a 1-d int64 input (lm); or say it with --task")
    if task == "regression":
        return DataInfo(name, "regression", shape, max(1, y.numel()))
    if task == "binary":
        return DataInfo(name, "binary", shape, 1)
    if task == "classification":
        if not _is_int(y) or y.dim() != 0:
            raise UsageError(f"--data {name!r}: --task classification needs an integer class index per sample, "
                             f"got a target {list(y.shape)} {y.dtype}")
        _scan(name, train, test, "the number of classes", _GIVE_INFO.format(task="classification"))
        return DataInfo(name, "classification", shape, _max_value(name, train, test, lm=False) + 1)
    if not (_is_int(y) and y.dim() == 1):
        raise UsageError(f"--data {name!r}: --task lm needs integer token targets, got {list(y.shape)} {y.dtype}")
    _scan(name, train, test, "the vocabulary size", _GIVE_INFO.format(task="lm"))
    return DataInfo(name, "lm", shape, _max_value(name, train, test, lm=True) + 1)


def _as_tensor(value: Any) -> Optional[torch.Tensor]:
    """View a sample field as a tensor for inspection; None when it is not numeric."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _is_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _columns_or_samples(ds: Dataset) -> Iterator[tuple[Any, Any]]:
    """``(inputs, target)`` of the whole dataset at once when it holds tensors in memory, else
    of each sample (a generic dataset can only be read one sample at a time)."""
    columns = tensors_of(ds)
    if columns is not None:
        yield split(columns)
        return
    for i in range(len(ds)):  # type: ignore[arg-type]
        yield split(ds[i])


def _scan(name: str, train: Dataset, test: Optional[Dataset], what: str, remedy: str) -> None:
    """UsageError when telling the task needs every label (``what``) and a set is a stream,
    which is never read ahead of training."""
    if any(isinstance(ds, IterableDataset) for ds in (train, test)):
        raise UsageError(f"--data {name!r}: {what} needs every label, and a stream (an IterableDataset) is not read "
                         f"ahead of training: {remedy}")


def _only_zero_one(train: Dataset, test: Optional[Dataset]) -> bool:
    """Every target of both sets is 0 or 1 (a binary task, not a regression)."""
    for ds in (train, test):
        if ds is None or len(ds) == 0:
            continue
        for _, y in _columns_or_samples(ds):
            y = torch.as_tensor(y)
            if not bool(((y == 0) | (y == 1)).all()):
                return False
    return True


def _max_value(name: str, train: Dataset, test: Optional[Dataset], lm: bool) -> int:
    """Largest integer among the targets (and, for a language model, the input tokens) over
    both sets, leaving out -100 (cross-entropy's ignore index); other negatives are an error.

    Scanning the test set too keeps the model's output wide enough for every test label.
    """
    low, high = 0, 0
    for ds in (train, test):
        if ds is None or len(ds) == 0:
            continue
        for inputs, y in _columns_or_samples(ds):
            values = [torch.as_tensor(y).reshape(-1)]
            if lm:
                values.append(torch.as_tensor(first_tensor(inputs)).reshape(-1))
            for v in values:
                v = v[v != IGNORE_INDEX]  # cross-entropy's "no target here" (padding in HF batches)
                if v.numel():
                    low, high = min(low, int(v.min())), max(high, int(v.max()))
    if low < 0:
        raise UsageError(f"--data {name!r}: found a negative class index or token ({low}); "
                         "labels and tokens must be integers from 0 upward")
    return high
