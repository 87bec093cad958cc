"""Built-in datasets, and user dataset factories given as ``package.module:factory``.

Every built-in returns ``TensorDataset``s of CPU tensors: the loader's in-memory fast path
gathers whole batches from ``.tensors`` with an index tensor instead of per-sample calls.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, get_args

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from scaleloop.data.batch import describe, first_sample, first_tensor, split, tensors_of
from scaleloop.data.settings import DATASET_NAMES
from scaleloop.data.info import DataInfo, Datasets, Task
from scaleloop.errors import UsageError
from scaleloop.plugins import call_factory, is_factory_spec, resolve_factory

#: Target value that cross-entropy skips (PyTorch's and Hugging Face's convention for padding).
IGNORE_INDEX = -100


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
    if name in ("tokenfile", "tokenfile-seq"):
        from scaleloop.data.tokenfile import token_files

        return token_files(name, data_dir, seq_len, vocab_size, seed)
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
    """Guess a ``DataInfo`` from ONE sample of ``train`` (``train[0]``, or a stream's first),
    cut into inputs and target by ``scaleloop.data.batch.split``; ``task`` (not ``auto``) says
    the task instead of guessing it. Start-up never reads the whole dataset: a dataset of a
    million samples, or one whose reads are slow or hang past the first, starts at once.

    The task, in order: ``task``; the training set's ``task`` attribute (one of the task names);
    else the sample's target: an integer scalar is ``classification``; integer tokens shaped like
    1-d integer input tokens are ``lm``; a 1-d float target of 0s and 1s is ``binary`` (one label,
    or several: multi-label); any other float target is ``regression``. A mapping sample without
    a target gives ``none`` (the model computes its own loss).

    Sizes: ``num_classes`` is the values per sample for binary and regression. For classification
    (and lm: the vocabulary) it is the dataset's ``num_classes`` (``vocab_size``) attribute when it
    declares one; else, for sets that hold their tensors in memory (``TensorDataset``,
    ``DictTensorDataset``), the largest label (token) of train and test + 1, in one vectorised pass
    (so are their 0/1 targets checked); else None: unknown, and a built-in model then asks for a
    declaration, while a model factory sizes its own head (:func:`scaleloop.models.build_model`).
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


def declared(dataset: Optional[Dataset]) -> tuple[Optional[str], Optional[int]]:
    """What a dataset says of itself: its ``task`` attribute (a task name) and its ``num_classes``
    (or ``vocab_size``) attribute (a positive integer); None for what it does not say."""
    def attribute(key: str) -> Any:
        try:
            return getattr(dataset, key, None)
        except Exception:  # a dataset's own __getattr__ may raise anything: then it says nothing
            return None

    task = attribute("task")
    sizes = [attribute(key) for key in ("num_classes", "vocab_size")]
    size = next((v for v in sizes if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)
    return (task if isinstance(task, str) and task in get_args(Task) else None), size


def _task_of(name: str, x: torch.Tensor, y: torch.Tensor, train: Dataset, test: Optional[Dataset],
             task: str) -> DataInfo:
    shape = tuple(x.shape)
    said_task, said_size = declared(train)
    # In-memory sets are read whole in one vectorised pass; any other set only through its one sample.
    train_columns = _columns(train)
    in_memory = train_columns is not None
    columns = [c for c in (train_columns, _columns(test)) if c is not None]
    if task == "auto":
        task = said_task or _guess_task(name, x, y, columns if in_memory else [(x, y)])
    if task in ("regression", "binary"):
        return DataInfo(name, task, shape, max(1, y.numel()))  # type: ignore[arg-type]
    if task == "none":
        return DataInfo(name, "none", shape, 0)
    lm = task == "lm"
    if not lm and (not _is_int(y) or y.dim() != 0):
        raise UsageError(f"--data {name!r}: --task classification needs an integer class index per sample, "
                         f"got a target {list(y.shape)} {y.dtype}")
    if lm and not (_is_int(y) and y.dim() == 1):
        raise UsageError(f"--data {name!r}: --task lm needs integer token targets, got {list(y.shape)} {y.dtype}")
    high = _max_value(name, columns if in_memory else [(x, y)], lm)  # the one sample: its negatives fail here
    size = said_size if said_size is not None else high + 1 if in_memory else None
    return DataInfo(name, task, shape, size)  # type: ignore[arg-type]


def _guess_task(name: str, x: torch.Tensor, y: torch.Tensor, columns: list[tuple[Any, Any]]) -> str:
    """The task the sample's target says (``columns``: whole in-memory sets, or the one sample)."""
    if y.is_floating_point():
        zero_one = y.dim() == 1 and all(bool(((t == 0) | (t == 1)).all()) for t in (torch.as_tensor(c[1]) for c in columns))
        return "binary" if zero_one else "regression"
    if _is_int(y) and y.dim() == 0:
        return "classification"
    if _is_int(y) and _is_int(x) and y.dim() == 1 and y.shape == x.shape:
        return "lm"
    raise UsageError(
        f"--data {name!r}: cannot tell the task from the first sample (input {list(x.shape)} "
        f"{x.dtype}, target {list(y.shape)} {y.dtype}); expected a float target (regression, or "
        "binary when it is 1-d of 0/1), an integer class index (classification), or an int64 tensor "
        "shaped like a 1-d int64 input (lm); or say it with --task")


def _as_tensor(value: Any) -> Optional[torch.Tensor]:
    """View a sample field as a tensor for inspection; None when it is not numeric."""
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def targets_padded(dataset: Optional[Dataset]) -> Optional[bool]:
    """Whether the targets of ``dataset`` hold :data:`IGNORE_INDEX` (-100: padding, or a position with
    no target), which the loss must skip: True or False, or None when that is not known.

    Known when the dataset says it (a ``padded`` attribute that is a bool: ``TokenFileDataset``'s
    windows never hold -100), or holds its tensors in memory (read once, in row blocks, so that
    a large token set needs no second copy of itself); a generic dataset or a stream is read one
    sample at a time, which start-up never does past the first: not known.
    """
    said = getattr(dataset, "padded", None) if dataset is not None else None
    if isinstance(said, bool):
        return said
    columns = _columns(dataset)
    if columns is None:
        return None
    target = columns[1]
    if not isinstance(target, torch.Tensor) or not _is_int(target):
        return False
    per_row = target[0].numel() if target.dim() and len(target) else 1
    rows = max(1, (1 << 22) // max(1, per_row))
    return any(bool((block == IGNORE_INDEX).any()) for block in target.split(rows))


def _is_int(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _columns(ds: Optional[Dataset]) -> Optional[tuple[Any, Any]]:
    """``(inputs, target)`` of a whole set that holds its tensors in memory, else None (a generic
    dataset is read one sample at a time, which start-up never does past the first)."""
    columns = tensors_of(ds) if ds is not None else None
    return split(columns) if columns is not None else None


def _max_value(name: str, columns: list[tuple[Any, Any]], lm: bool) -> int:
    """Largest integer among the targets (and, for a language model, the input tokens) of
    ``columns``, leaving out -100 (cross-entropy's ignore index); other negatives are an error.

    Both sets' columns count: the model's output must be wide enough for every test label too.
    """
    low, high = 0, 0
    for inputs, y in columns:
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
