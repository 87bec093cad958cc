"""Evaluation during training: --eval-every, --eval-batches' fixed sample, --eval-train."""
from __future__ import annotations

import csv
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from scaleloop.config import TrainConfig
from scaleloop.data.batch import DictTensorDataset
from scaleloop.data.info import DataInfo, Datasets
from scaleloop.errors import UsageError
from scaleloop.loop.evaluation import (EvalResult, Evaluations, StreamHead, check_eval_data, draw_indices,
                                       evaluate, own_rng, sample_of)
from scaleloop.loop.text import format_result
from scaleloop.loop.training import RunResult, train
from scaleloop.output.trackers import tracker_row
from scaleloop.runtime.collectives import shard_indices
from scaleloop.runtime.dist import DistEnv
from scaleloop.runtime.frames import where_of
from scaleloop.strategies.single import SingleDevice

from runs import CPU, quiet, small  # tests/loop/runs.py


def rows_of(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class Plain(Dataset):
    """Read through ``__getitem__``: evaluation goes through a DataLoader, as for most user sets."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([float(i)]), torch.tensor(i % 2)


# --- the fixed sample ----------------------------------------------------------------------

def test_sample_is_drawn_from_the_seed_alone() -> None:
    x, y = torch.arange(1000.0).unsqueeze(1), torch.arange(1000) % 3
    data = TensorDataset(x, y)
    a, b, other = sample_of(data, 64, seed=7), sample_of(data, 64, seed=7), sample_of(data, 64, seed=8)
    assert isinstance(a, TensorDataset) and len(a) == 64
    assert torch.equal(a.tensors[0], b.tensors[0])   # every process draws the same samples
    assert not torch.equal(a.tensors[0], other.tensors[0])
    index = a.tensors[0].squeeze(1).long()
    assert len(set(index.tolist())) == 64 and torch.equal(index, index.sort().values)   # distinct, in order
    assert torch.equal(a.tensors[1], y[index])     # each sample whole: its input with its own target


def test_sample_of_a_set_no_larger_is_the_set() -> None:
    data = TensorDataset(torch.zeros(10, 2), torch.zeros(10))
    assert sample_of(data, 10, seed=0) is data and sample_of(data, 64, seed=0) is data


def test_sample_keeps_the_kind_of_set() -> None:
    named = DictTensorDataset(x=torch.arange(50.0), y=torch.arange(50))
    picked = sample_of(named, 5, seed=1)
    assert isinstance(picked, DictTensorDataset) and torch.equal(picked.tensors["x"].long(), picked.tensors["y"])
    plain = sample_of(Plain(torch.arange(50.0), torch.arange(50)), 5, seed=1)
    assert isinstance(plain, Subset) and plain.indices == picked.tensors["y"].tolist()   # the same draw
    head = sample_of(Stream(100), 7, seed=1)
    assert isinstance(head, StreamHead) and [int(s[0]) for s, _ in head] == list(range(7))


def test_draw_from_a_very_large_set_needs_no_permutation() -> None:
    n = 10**9   # a permutation would take 8 GB
    index = draw_indices(n, 1000, seed=3)
    assert len(index) == 1000 and len(torch.unique(index)) == 1000
    assert 0 <= int(index.min()) and int(index.max()) < n and torch.equal(index, index.sort().values)
    assert torch.equal(index, draw_indices(n, 1000, seed=3))


@pytest.mark.parametrize("world", [2, 3])
def test_the_sample_split_over_ranks_counts_each_sample_once(world: int) -> None:
    data = TensorDataset(torch.randn(300, 4), torch.randint(0, 2, (300,)))
    sample = sample_of(data, 101, seed=0)   # drawn without the rank: the same set on every rank
    parts = [shard_indices(len(sample), DistEnv(rank=r, world_size=world)) for r in range(world)]
    assert [i for part in parts for i in part] == list(range(101))


def test_sampled_evaluation_is_the_same_summed_over_two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Per-rank sums of the evaluation, added up as the all-reduce would, equal one rank's total.
    from scaleloop.loop import evaluation as module

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(500, 6), torch.randint(0, 3, (500,)))
    info = DataInfo("t", "classification", (6,), 3)
    model = torch.nn.Linear(6, 3)
    sample = sample_of(data, 77, seed=5)
    one = evaluate(model, sample, info, SingleDevice(CPU), batch_size=16)
    sums: list[torch.Tensor] = []
    monkeypatch.setattr(module, "sum_over_ranks", lambda t, env: (sums.append(t.clone()), t)[1])
    for rank in range(2):
        evaluate(model, sample, info, SingleDevice(DistEnv(rank=rank, world_size=2)), batch_size=16)
    total = (sums[0] + sums[1]).tolist()
    assert total[4] == 77 and sums[0][4] + sums[1][4] == 77 and min(sums[0][4], sums[1][4]) > 0
    assert total[0] / total[1] == pytest.approx(one.loss, rel=1e-12)
    assert total[2] / total[3] == one.accuracy


# --- checks --------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value", [("eval_every", 0), ("eval_every", -3), ("eval_batches", 0),
                                         ("eval_batches", -1)])
def test_bad_values_are_refused(flag: str, value: int) -> None:
    with pytest.raises(UsageError, match=f"--{flag.replace('_', '-')} must be a positive"):
        TrainConfig(**{flag: value}).validate()


def test_eval_flags_without_a_test_set_are_refused() -> None:
    train_only = Datasets(TensorDataset(torch.zeros(4, 1), torch.zeros(4)), None, DataInfo("t", "binary", (1,), 1))
    for flags in (dict(eval_batches=2), dict(eval_every=5)):
        with pytest.raises(UsageError, match="this data has none"):
            check_eval_data(TrainConfig(**flags).evaluation, train_only)
    check_eval_data(TrainConfig(eval_batches=2, eval_train=True).evaluation, train_only)   # the training set's
    check_eval_data(TrainConfig().evaluation, train_only)


def test_run_without_a_test_set_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--eval-batches 2 evaluates the test set"):
        train(small(tmp_path, test_fraction=0.0, eval_batches=2), CPU, log=quiet)
    assert not (tmp_path / "run").exists()


def test_old_config_files_load_without_the_new_settings(tmp_path: Path) -> None:
    from scaleloop.config import load_toml, resolve

    path = tmp_path / "config.toml"
    path.write_text('model = "simplenet"\ndata = "random"\nlog_every = 5\n')
    cfg = resolve(load_toml(path), {})
    assert (cfg.evaluation.eval_every, cfg.evaluation.eval_batches, cfg.evaluation.eval_train) == (None, None, False)


# --- in a run ------------------------------------------------------------------------------

def test_eval_rows_come_at_multiples_of_eval_every(tmp_path: Path) -> None:
    lines: list[str] = []
    result = train(small(tmp_path, eval_every=3, eval_batches=1, eval_train=True), CPU, log=lines.append)
    rows = rows_of(result.run_dir)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [int(r["step"]) for r in evals] == [3, 6]
    assert [int(r["epoch"]) for r in evals] == [1, 2]
    for r in evals:
        assert 0 < float(r["test_loss"]) < 10 and 0 <= float(r["test_acc"]) <= 1 and float(r["train_eval_loss"]) > 0
        assert r["train_loss"] == ""    # an eval row is no log row
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [int(r["step"]) for r in epochs] == [4, 8] and all(r["train_eval_loss"] for r in epochs)
    assert [int(r["step"]) for r in rows if r["kind"] == "step"] == [2, 4, 6, 8]   # as without evaluations
    assert any(line.startswith("step 3: test loss") and "train loss (sampled)" in line for line in lines)
    assert any(line.startswith("evaluation every 3 steps") for line in lines)
    # The sample: 1 batch of 64 of the 256 training samples; the test set (51) is no larger than it.
    assert result.train_eval is not None and (result.train_eval.samples, result.train_eval.of) == (64, 256)
    assert result.test is not None and result.test.of is None and result.train_eval_step == 8


def test_eval_at_an_epoch_end_reuses_its_evaluation(tmp_path: Path) -> None:
    result = train(small(tmp_path, eval_every=2), CPU, log=quiet)
    rows = rows_of(result.run_dir)
    evals = {int(r["step"]): r for r in rows if r["kind"] == "eval"}
    assert sorted(evals) == [2, 4, 6, 8]
    for epoch_row in (r for r in rows if r["kind"] == "epoch"):
        assert evals[int(epoch_row["step"])]["test_loss"] == epoch_row["test_loss"]   # one evaluation, two rows
    assert all(r["train_eval_loss"] == "" for r in rows)   # no --eval-train


def test_sampled_test_set_is_said_so(tmp_path: Path) -> None:
    result = train(small(tmp_path, n_samples=1000, batch_size=16, epochs=1, max_steps=2, eval_batches=2), CPU,
                   log=quiet)
    assert result.test is not None and (result.test.samples, result.test.of) == (32, 200)
    assert "32 of 200 samples, sampled" in format_result(result)


def write_dropout_module(directory: Path) -> None:
    (directory / "dropmodel.py").write_text(textwrap.dedent('''
        import torch
        from torch import nn
        from torch.utils.data import Dataset

        class Plain(Dataset):
            def __init__(self, n, seed):
                g = torch.Generator().manual_seed(seed)
                self.x = torch.randn(n, 8, generator=g)
                self.y = (self.x.sum(1) > 0).long()
            def __len__(self):
                return len(self.x)
            def __getitem__(self, i):
                return self.x[i], self.y[i]

        def data():
            return Plain(96, 1), Plain(37, 2)

        def model():
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))
    '''))


@pytest.fixture
def dropout_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Training that draws random numbers (dropout) and sets read through a DataLoader, whose
    iterator draws its seed from the same global generator."""
    write_dropout_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def run(name: str, **flags) -> Path:
        cfg = small(tmp_path, name, model="dropmodel:model", data="dropmodel:data", batch_size=16, epochs=2,
                    log_every=3, **flags)
        return train(cfg, CPU, log=quiet).run_dir
    return run


def test_evaluations_do_not_change_the_training(dropout_run) -> None:
    plain = weights(dropout_run("plain"))
    assert_bitwise_equal(plain, weights(dropout_run("every2", eval_every=2)))
    assert_bitwise_equal(plain, weights(dropout_run("all", eval_every=2, eval_batches=1, eval_train=True)))


def test_an_evaluation_inside_an_epoch_draws_none_of_the_trainings_random_numbers() -> None:
    # Why the isolation is needed: the DataLoader that reads such a set draws from the global generator.
    data = Plain(torch.randn(20, 3), torch.randint(0, 2, (20,)))
    info = DataInfo("t", "classification", (3,), 2)
    model = torch.nn.Linear(3, 2)
    before = torch.get_rng_state()
    evaluate(model, data, info, SingleDevice(CPU))
    assert not torch.equal(before, torch.get_rng_state())
    evals = Evaluations(model, TrainConfig(eval_every=1, eval_train=True).evaluation, Datasets(data, data, info),
                        SingleDevice(CPU), batch_size=64, seed=0, loss_fn=None, keep_target=False, metrics={})
    before = torch.get_rng_state()
    with own_rng(CPU.device):
        torch.rand(3)
    assert evals.of_test_set(isolated=True) is not None and evals.of_training_set() is not None
    assert torch.equal(before, torch.get_rng_state())


def test_resume_continues_the_evaluations_at_multiples(tmp_path: Path) -> None:
    # 4 epochs of 4 steps; the first run stops at step 7, inside epoch 2.
    first = train(small(tmp_path, "r", epochs=4, eval_every=3, max_steps=7), CPU, log=quiet)
    assert [int(r["step"]) for r in rows_of(first.run_dir) if r["kind"] == "eval"] == [3, 6]
    resumed = train(small(tmp_path, "r", epochs=4, eval_every=3), CPU, log=quiet)
    assert [int(r["step"]) for r in rows_of(resumed.run_dir) if r["kind"] == "eval"] == [3, 6, 9, 12, 15]
    whole = train(small(tmp_path, "whole", epochs=4, eval_every=3), CPU, log=quiet)
    assert_bitwise_equal(weights(whole.run_dir), weights(resumed.run_dir))
    plain = train(small(tmp_path, "plain", epochs=4), CPU, log=quiet)
    assert_bitwise_equal(weights(plain.run_dir), weights(resumed.run_dir))


def test_a_failing_evaluation_is_placed_at_its_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = Evaluations.of_test_set

    def failing(self, *, isolated: bool = False):
        if isolated:
            raise RuntimeError("boom")
        return real(self, isolated=isolated)
    monkeypatch.setattr(Evaluations, "of_test_set", failing)
    with pytest.raises(RuntimeError, match="boom") as caught:
        train(small(tmp_path, eval_every=3), CPU, log=quiet)
    assert where_of(caught.value)["during"] == "the evaluation at step 3"


# --- reporting -----------------------------------------------------------------------------

def test_summary_says_what_its_train_loss_is(tmp_path: Path) -> None:
    result = train(small(tmp_path, eval_train=True), CPU, log=quiet)
    text = format_result(result)
    assert "final train loss" not in text
    assert re.search(rf"\n  train loss +{result.train_loss:.4f}, the mean over epoch 2, steps 5-8;", text)
    assert result.window_steps == (7, 8) and math.isfinite(result.window_loss)
    assert f"last log window (steps 7-8) {result.window_loss:.4f}" in text
    assert "train loss (eval mode)" in text and "at step 8, in evaluation mode (256 samples)" in text


def test_summary_of_a_run_stopped_inside_an_epoch() -> None:
    result = RunResult(run_dir=None, device="cpu", strategy="single", world_size=1, precision="fp32", epochs=1,
                       steps=6, samples=6, train_loss=0.5, test=EvalResult(1.0, 0.5, 10, of=40), samples_per_s=1.0,
                       train_s=1.0, wall_s=1.0, parameters=1, dropped_per_epoch=0, in_memory_data=True,
                       train_loss_over="epoch 2 so far, steps 5-6", window_steps=(6, 6), window_loss=0.25)
    text = format_result(result)
    assert "0.5000, the mean over epoch 2 so far, steps 5-6; last log window (step 6) 0.2500" in text
    assert "10 of 40 samples, sampled" in text


def test_eval_rows_reach_the_tracker_under_their_names() -> None:
    row = tracker_row("eval", dict(test_loss=1.5, test_acc=0.5, train_eval_loss=1.25, wall_s=3.0))
    assert row == {"test/loss": 1.5, "test/acc": 0.5, "train/eval_loss": 1.25, "train/wall_s": 3.0}
