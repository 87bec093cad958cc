"""Start-up reads one sample (issue 29 point 1), and the run says its task (point 7).

The task and the sizes come from ONE sample, from one vectorised pass over in-memory tensors,
or from what the dataset declares (``task``, ``num_classes``, ``vocab_size`` attributes); a
dataset of a million windows, or one whose reads past the first hang, starts at once.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from scaleloop.config import TrainConfig
from scaleloop.data.datasets import build_datasets, infer_info
from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError
from scaleloop.loop.build import build_data_and_model, build_run
from scaleloop.loop.losses import describe_task, resolve_loss
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv

MODULE = "scaleloop_test_task_data"
VOCAB, BLOCK = 11, 8


class Counting(Dataset):
    """Windows of a token corpus, as nanoGPT users write them; records every index read, and
    fails on any index but 0 until ``open`` (a dataset that would hang there hangs start-up)."""

    def __init__(self, n: int = 1000, **declared: Any) -> None:
        self.data = torch.randint(0, VOCAB, (n + BLOCK,), generator=torch.Generator().manual_seed(0))
        self.n, self.reads, self.open = n, [], False
        self.__dict__.update(declared)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads.append(i)
        if i != 0 and not self.open:
            raise AssertionError(f"start-up read sample {i}")
        chunk = self.data[i:i + BLOCK + 1]
        return chunk[:-1], chunk[1:]


class Labelled(Counting):
    """The same, with one class index per sample (the first token of the next window)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, y = super().__getitem__(i)
        return x.float(), y[0]


class MultiLabel(Dataset):
    """K = 5 float 0/1 labels per sample (multi-label), read one sample at a time."""

    def __init__(self, n: int = 96) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=gen)
        self.y = (self.x[:, :5] > 0).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class CharModel(nn.Module):
    """Sizes its own vocabulary (``width``): it never reads ``info.num_classes``."""

    def __init__(self, width: int = VOCAB) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


@pytest.fixture
def user_module(monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """``register(name=factory, ...)``: the factories importable as ``MODULE:name``."""
    module = types.ModuleType(MODULE)
    monkeypatch.setitem(__import__("sys").modules, MODULE, module)

    def register(**factories: Any) -> str:
        for name, factory in factories.items():
            setattr(module, name, factory)
        return MODULE

    return register


def _cfg(tmp_path: Any, **changes: Any) -> TrainConfig:
    return TrainConfig(**{**dict(epochs=1, max_steps=2, batch_size=16, progress=False, tensorboard=False,
                                 checkpoints=False, device="cpu", out=str(tmp_path / "run")), **changes}).validate()


def test_start_up_reads_only_the_first_sample(tmp_path: Any, user_module: Callable[..., str]) -> None:
    corpus, labelled = Counting(), Labelled(num_classes=VOCAB)
    mod = user_module(corpus=lambda: corpus, labelled=lambda: labelled, model=lambda: CharModel())
    run = build_run(_cfg(tmp_path, data=f"{mod}:corpus", model=f"{mod}:model"), DistEnv(device=torch.device("cpu")))
    assert set(corpus.reads) == {0}, corpus.reads
    # The vocabulary is not known from one sample: the model's output width is taken as it.
    assert run.data.info == DataInfo(f"{mod}:corpus", "lm", (BLOCK,), None)
    # A built-in model on a generic dataset that declares its number of classes.
    run = build_run(_cfg(tmp_path, data=f"{mod}:labelled"), DistEnv(device=torch.device("cpu")))
    assert set(labelled.reads) == {0} and run.data.info.num_classes == VOCAB
    labelled.open = True   # training reads the rest
    lines: list[str] = []
    result = train(_cfg(tmp_path, data=f"{mod}:labelled"), DistEnv(device=torch.device("cpu")), log=lines.append)
    assert result.steps == 2 and f"task: classification over {VOCAB} classes, loss CrossEntropyLoss" in lines


def test_in_memory_sets_are_sized_in_one_vectorised_pass() -> None:
    x = torch.randn(40, 3)
    train_set = TensorDataset(x, torch.arange(40) % 4)
    test_set = TensorDataset(x[:2], torch.tensor([0, 6]))   # the test set's label 6 widens the head
    assert infer_info("t", train_set, test_set) == DataInfo("t", "classification", (3,), 7)
    tokens = torch.randint(0, 5, (10, BLOCK + 1))
    assert infer_info("t", TensorDataset(tokens[:, :-1], tokens[:, 1:])).num_classes == int(tokens.max()) + 1


def test_multi_label_float_targets_are_binary(tmp_path: Any, user_module: Callable[..., str]) -> None:
    ds = MultiLabel()
    in_memory = TensorDataset(ds.x, ds.y)
    assert infer_info("m", ds) == DataInfo("m", "binary", (6,), 5)
    assert infer_info("m", in_memory) == DataInfo("m", "binary", (6,), 5)
    # One value in the whole column that is not 0 or 1 makes an in-memory set a regression.
    assert infer_info("m", TensorDataset(ds.x, torch.cat([ds.y[:-1], ds.y[-1:] * 0.5]))).task == "regression"
    assert infer_info("m", TensorDataset(ds.x, torch.randn(96, 5))) == DataInfo("m", "regression", (6,), 5)
    mod = user_module(multilabel=lambda: (MultiLabel(), MultiLabel(32)))
    lines: list[str] = []
    result = train(_cfg(tmp_path, data=f"{mod}:multilabel", max_steps=None, epochs=2), DistEnv(), log=lines.append)
    assert "task: multi-label (binary) over 5 labels, loss BCEWithLogitsLoss" in lines, lines[:3]
    assert result.test is not None and result.test.accuracy > 0.6   # per label: the head has 5 outputs
    weights = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert list(weights.values())[-1].shape == (5,)


def test_what_the_dataset_declares_is_taken(user_module: Callable[..., str]) -> None:
    ds = MultiLabel()
    ds.task = "regression"
    assert infer_info("d", ds).task == "regression"
    assert infer_info("d", Counting(vocab_size=50)) == DataInfo("d", "lm", (BLOCK,), 50)
    # Attributes that are not a task name or a positive integer say nothing.
    assert infer_info("d", Counting(task="train", num_classes=0)) == DataInfo("d", "lm", (BLOCK,), None)
    assert infer_info("d", ds, task="binary").task == "binary"   # --task wins


def test_an_unknown_number_of_classes_is_said_in_one_line(tmp_path: Any, user_module: Callable[..., str]) -> None:
    def reads_info(info: DataInfo) -> nn.Module:
        return nn.Linear(3, info.num_classes)  # type: ignore[arg-type]

    mod = user_module(labelled=Labelled, reads_info=reads_info, narrow=lambda: CharModel(width=4), corpus=Counting)
    for model, expected in [("simplenet", "model 'simplenet' is sized by the number of classes, which dataset "
                             f"'{mod}:labelled' does not say and one sample cannot tell: give the dataset a "
                             "'num_classes' attribute"),
                            (f"{mod}:reads_info", "with info.num_classes None: dataset")]:
        with pytest.raises(UsageError) as info:
            build_data_and_model(_cfg(tmp_path, data=f"{mod}:labelled", model=model))
        assert expected in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UsageError, match="'vocab_size' attribute"):
        build_data_and_model(_cfg(tmp_path, data=f"{mod}:corpus", model="tinygpt"))
    # A model narrower than the labels: the first batch says so (not a CUDA device-side assert).
    loss = resolve_loss(None, DataInfo("c", "lm", (BLOCK,), None))
    with pytest.raises(UsageError, match=r"the batch holds token 9, but the model outputs 4 scores"):
        loss(torch.randn(2, BLOCK, 4), torch.full((2, BLOCK), 9))
    assert loss(torch.randn(2, BLOCK, 10), torch.full((2, BLOCK), 9)).dim() == 0


@pytest.mark.parametrize("info, loss, takes, expected", [
    (DataInfo("d", "classification", (4,), 10), None, False, "task: classification over 10 classes, loss CrossEntropyLoss"),
    (DataInfo("d", "classification", (4,), None), None, False,
     "task: classification (classes: the model's output width), loss CrossEntropyLoss"),
    (DataInfo("d", "binary", (4,), 1), None, False, "task: binary, loss BCEWithLogitsLoss"),
    (DataInfo("d", "binary", (4,), 5), None, False, "task: multi-label (binary) over 5 labels, loss BCEWithLogitsLoss"),
    (DataInfo("d", "regression", (4,), 1), None, False, "task: regression, loss MSELoss"),
    (DataInfo("d", "regression", (4,), 3), "m:l1", False, "task: regression of 3 values per sample, loss m:l1 (--loss)"),
    (DataInfo("d", "lm", (8,), 65), None, False, "task: language modelling over 65 tokens, loss CrossEntropyLoss (next token)"),
    (DataInfo("d", "lm", (8,), 65), None, True, "task: language modelling over 65 tokens, loss: the model's own"),
    (DataInfo("d", "none", (8,), 0), None, False, "task: none (the samples hold no target), loss: the model's own"),
])
def test_the_task_line(info: DataInfo, loss: Any, takes: bool, expected: str) -> None:
    assert describe_task(info, loss, takes) == expected


def test_the_header_of_a_built_in_dataset_says_its_task(tmp_path: Any) -> None:
    lines: list[str] = []
    train(_cfg(tmp_path, data="random", n_samples=64, max_steps=1), DistEnv(), log=lines.append)
    assert lines[1] == "task: binary, loss BCEWithLogitsLoss", lines[:2]
    assert build_datasets("tokens", n_samples=8, seq_len=4, vocab_size=7).info.num_classes == 7
