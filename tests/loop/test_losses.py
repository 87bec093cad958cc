"""Losses (scaleloop.loop.losses): what a model may return, the losses and tasks built on it, and
exact losses over -100 padding.

A model that returns its prediction in a tuple, a mapping, or an object with ``logits``
trains to exactly the weights of the same model returning the tensor; a model that computes
its own loss trains on it; anything else stops with one line (and exit 2 from the CLI).

Over -100 padding, in one process: a step is the mean over the real targets of the whole step,
so cutting it into micro-batches (as ranks and --accumulate do) trains the same model, with
scaleloop's loss and with a Hugging Face causal LM's own; runs without padding do not count.
The 2-process runs: tests/distributed/test_thirdparty_models.py and test_usermodels.py;
verify's diagnosis: tests/verify/test_verify_probes.py.
"""
from __future__ import annotations

import importlib.util
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from scaleloop import DictTensorDataset
from scaleloop.config import TrainConfig
from scaleloop.data.datasets import infer_info, targets_padded
from scaleloop.data.info import DataInfo
from scaleloop.data.tokenfile import TokenFileDataset
from scaleloop.errors import UsageError
from scaleloop.loop.build import build_run
from scaleloop.loop.losses import (Counting, counting_for, own_loss, prediction_of, resolve_loss,
                                   shape_mismatch)
from scaleloop.loop.step import Observer, steps_of, train_step
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv


SCRIPTS = Path(__file__).resolve().parents[1] / "distributed" / "scripts"
sys.path.insert(0, str(SCRIPTS.parent))
from procs import run  # noqa: E402
INFO = DataInfo("t", "classification", (4,), 3)


class HFStyle(OrderedDict):
    """Like transformers' ModelOutput: a mapping whose entries are also attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Attrs:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def test_the_prediction_is_found_by_one_rule() -> None:
    t = torch.randn(2, 3)
    assert prediction_of(t) is t
    assert prediction_of((t, torch.zeros(1))) is t and prediction_of([t]) is t
    assert prediction_of({"logits": t, "hidden": 1}) is t
    assert prediction_of(Attrs(logits=t)) is t
    assert prediction_of(HFStyle(loss=None, logits=t)) is t
    for bad, named in [("x", "a str"), ({"scores": t}, "a dict with keys ['scores']"), ((), "a tuple of 0")]:
        with pytest.raises(UsageError) as info:
            prediction_of(bad)
        assert named in str(info.value) and "'logits'" in str(info.value)


def test_a_model_s_own_loss_is_used_unless_the_user_gives_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    own = torch.tensor(7.0)
    builtin = resolve_loss(None, INFO)
    assert own_loss(HFStyle(loss=own, logits=t)) is own and own_loss(Attrs(loss=None, logits=t)) is None
    assert builtin(HFStyle(loss=own, logits=t), y) is not None and float(builtin(HFStyle(loss=own, logits=t), y)) == 7.0
    assert torch.equal(builtin({"logits": t}, y), F.cross_entropy(t, y))
    with pytest.raises(UsageError, match="no target"):
        builtin({"logits": t}, None)
    (tmp_path / "mylosses.py").write_text(
        "import torch\n"
        "def l1(pred, target):\n    return (pred - target).abs().mean()\n"
        "def per_sample(pred, target):\n    return (pred - target).abs().mean(1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mine = resolve_loss("mylosses:l1", INFO)
    target = torch.zeros(4, 3)
    # the user's loss is given the prediction, and wins over the model's own loss
    assert torch.equal(mine(HFStyle(loss=own, logits=t), target), t.abs().mean())
    with pytest.raises(UsageError, match=r"returned \[4\], not a scalar"):
        resolve_loss("mylosses:per_sample", INFO)(t, target)


def test_a_loss_class_means_an_instance_with_its_defaults() -> None:
    """``--loss torch.nn:SmoothL1Loss`` (a class where an instance is expected): called with the
    prediction and the target, the class would take them as its settings and fail obscurely."""
    pred, target = torch.randn(4, 3), torch.randn(4, 3)
    assert torch.equal(resolve_loss("torch.nn:SmoothL1Loss", INFO)(pred, target), F.smooth_l1_loss(pred, target))
    with pytest.raises(UsageError, match="is a class that cannot be made without arguments"):
        resolve_loss("torch.nn:Bilinear", INFO)


class Returning(nn.Module):
    """The same network, returning its prediction the way ``kind`` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = nn.Sequential(nn.Flatten(1), nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> Any:
        out = self.net(x)
        if self.kind == "tuple":
            return out, x.sum()
        if self.kind == "dict":
            return {"logits": out}
        if self.kind == "object":
            return Attrs(logits=out, loss=None)
        return out


class TakesTargets(Returning):
    """nanoGPT's convention: ``forward(idx, targets=None)`` returns ``(logits, loss)`` given the
    targets, and without them only the first row's logits (nanoGPT: the last position's)."""

    def forward(self, idx: torch.Tensor, targets: Any = None) -> Any:
        out = self.net(idx)
        if targets is None:
            return out[:1]
        return out, F.cross_entropy(out, targets)


class FirstRowOnly(Returning):
    def forward(self, x: torch.Tensor) -> Any:
        return self.net(x)[:1]


@pytest.fixture
def models_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "returning.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_losses import FirstRowOnly, Returning, TakesTargets\n"
        "def make(kind):\n    return lambda info: Returning(kind)\n"
        "tensor, tuple_, dict_, object_ = (make(k) for k in ('tensor', 'tuple', 'dict', 'object'))\n"
        "takes_targets = lambda info: TakesTargets('tensor')\n"
        "first_row_only = lambda info: FirstRowOnly('tensor')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "returning"


def _train(tmp_path: Path, name: str, **changes: Any) -> dict[str, torch.Tensor]:
    cfg = TrainConfig(**{**dict(data="digits", epochs=1, max_steps=5, batch_size=32, progress=False,
                                tensorboard=False, checkpoints=False, device="cpu", out=str(tmp_path / name)),
                         **changes}).validate()
    train(cfg, DistEnv(device=torch.device("cpu")), log=lambda _msg: None)
    return torch.load(tmp_path / name / "model.pt", weights_only=True)


def test_every_output_form_trains_the_same_weights(tmp_path: Path, models_module: str) -> None:
    reference = _train(tmp_path, "tensor", model=f"{models_module}:tensor")
    for kind in ("tuple_", "dict_", "object_"):
        got = _train(tmp_path, kind, model=f"{models_module}:{kind}")
        assert reference.keys() == got.keys()
        assert all(torch.equal(reference[k], got[k]) for k in reference), kind


def test_a_forward_that_takes_targets_gets_them_and_its_own_loss_is_trained_on(tmp_path: Path,
                                                                               models_module: str) -> None:
    """(x, y) samples and ``forward(idx, targets=None)``: called as ``model(idx=x, targets=y)``, and the
    ``(logits, loss)`` it returns trains on its own loss (here the same cross-entropy: the same weights)."""
    reference = _train(tmp_path, "tensor", model=f"{models_module}:tensor")
    got = _train(tmp_path, "targets", model=f"{models_module}:takes_targets")
    assert all(torch.equal(reference[k], got[k]) for k in reference)
    t, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    assert own_loss((t, torch.tensor(0.5)), given_target=True) is not None
    assert own_loss((t, torch.tensor(0.5))) is None   # (output, aux) from a model never given the target


def test_a_prediction_that_cannot_fit_the_target_is_one_line_naming_both_shapes(tmp_path: Path,
                                                                                models_module: str) -> None:
    with pytest.raises(UsageError) as caught:
        _train(tmp_path, "short", model=f"{models_module}:first_row_only")
    assert str(caught.value).startswith("the model's prediction [1, 10] does not fit the target [32] "
                                        "(classification: one row of class scores per sample, e.g. [32, C]); "
                                        "likely: the model returns 1 row(s) of scores but the target holds 32 labels")
    lm = INFO.__class__("t", "lm", (8,), 50)
    said = shape_mismatch(lm, torch.randn(4, 1, 50), torch.zeros(4, 8, dtype=torch.long))
    assert said is not None and "[4, 1, 50] does not fit the target [4, 8]" in said and "fewer positions" in said
    assert shape_mismatch(lm, torch.randn(4, 8, 50), torch.zeros(4, 8, dtype=torch.long)) is None
    image = INFO.__class__("seg", "classification", (3, 4, 4), 5)
    assert shape_mismatch(image, torch.randn(2, 5, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long)) is None


def test_regression_is_inferred_from_float_targets_and_metrics_are_reported(tmp_path: Path) -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        cfg = TrainConfig(model="usermodels:Regressor", data="usermodels:regression_data", epochs=3,
                          batch_size=32, progress=False, tensorboard=False, checkpoints=False, device="cpu",
                          metrics="usermodels:abs_error", out=str(tmp_path / "reg")).validate()
        lines: list[str] = []
        result = train(cfg, DistEnv(device=torch.device("cpu")), log=lines.append)
    finally:
        sys.path.remove(str(SCRIPTS))
    assert result.test is not None
    assert result.test.accuracy != result.test.accuracy  # NaN: a regression has no accuracy
    assert set(result.test.metrics) == {"abs_error"} and 0 < result.test.metrics["abs_error"] < 2
    last = [line for line in lines if line.startswith("epoch 3:")][0]
    assert "accuracy" not in last and "abs_error" in last, last


def test_task_can_be_said_instead_of_inferred(tmp_path: Path) -> None:
    from scaleloop.loop.build import build_data_and_model

    data, model = build_data_and_model(TrainConfig(data="random", task="regression", n_samples=64))
    assert data.info.task == "regression" and data.info.num_classes == 1
    with pytest.raises(UsageError, match="--task classification needs an integer class index"):
        build_data_and_model(TrainConfig(data="random", task="classification", n_samples=64))


def test_an_output_no_rule_reads_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # A fork of the tests' fork server (procs.run), as the suite's other runs of the command are.
    res = run([sys.executable, "-m", "scaleloop", "train", "--model", "usermodels:Chatty", "--epochs", "1",
               "--no-progress", "--out", str(tmp_path / "run")], cwd=SCRIPTS, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("scaleloop: error:")]
    assert errors == ["scaleloop: error: the model returned a str; expected a tensor, a tuple or list whose first "
                      "element is the prediction, or a mapping or object with 'logits' (a Hugging Face "
                      "ModelOutput) or with its own 'loss'"], res.stderr


# --- exact losses over -100 padding ---------------------------------------------------------------

CPU = DistEnv(device=torch.device("cpu"))
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers (a test extra)")


@pytest.fixture(autouse=True)
def scripts_importable():
    """``usermodels`` and ``hfmodels`` (tests/distributed/scripts) as ``--model``/``--data`` factories."""
    sys.path.insert(0, str(SCRIPTS))
    yield
    sys.path.remove(str(SCRIPTS))


class Samples(Dataset):
    """Read one sample at a time: what it holds is not known at start-up."""

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.y[i].clamp(min=0), self.y[i]


TOKENS = torch.arange(24).reshape(3, 8) % 5
PADDED = TOKENS.masked_fill(torch.arange(8) >= 6, -100)


def test_whether_targets_hold_padding_is_known_in_memory_or_when_said() -> None:
    assert targets_padded(TensorDataset(TOKENS, PADDED)) is True
    assert targets_padded(TensorDataset(TOKENS, TOKENS)) is False
    assert targets_padded(DictTensorDataset(input_ids=TOKENS, labels=PADDED)) is True
    assert targets_padded(TensorDataset(TOKENS.float(), TOKENS.float())) is False   # float targets: no index
    assert targets_padded(Samples(PADDED)) is None
    said = Samples(PADDED)
    said.padded = False   # type: ignore[attr-defined]
    assert targets_padded(said) is False
    assert TokenFileDataset.padded is False


class OwnLoss(nn.Module):
    """Takes ``labels`` and returns its own mean loss over the real ones: it cannot be told a count."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> dict[str, Any]:
        logits = self.embed(input_ids)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_what_counts_follows_the_targets_and_the_loss() -> None:
    padded, plain = TensorDataset(TOKENS, PADDED), TensorDataset(TOKENS, TOKENS)
    lm = infer_info("t", padded)
    model = nn.Linear(1, 1)
    counting, notes = counting_for(lm, padded, model, None, False)
    assert counting == Counting(per_sample=8) and "each step's loss is the mean over the real targets" in notes[0]
    assert counting_for(lm, plain, model, None, False) == (None, [])              # no padding: nothing counts
    assert counting_for(lm, padded, model, "torch.nn.functional:cross_entropy", False) == (None, [])   # --loss
    # Not known (read one sample at a time): a language model's steps count anyway, without a note.
    assert counting_for(lm, Samples(PADDED), model, None, False) == (Counting(per_sample=8), [])
    classes = infer_info("c", TensorDataset(TOKENS[:, 0].float(), PADDED[:, -1]), task="classification")
    assert counting_for(classes, TensorDataset(TOKENS, PADDED[:, -1]), model, None, False)[0] == Counting(1)
    assert counting_for(classes, Samples(PADDED[:, -1]), model, None, False) == (None, [])
    # A model's own loss that cannot be told the count: not counted, and said.
    mapped = DictTensorDataset(input_ids=TOKENS, labels=PADDED)
    counting, notes = counting_for(infer_info("m", mapped), mapped, OwnLoss(), None, True)
    assert counting is None and "cannot be told the step's count of real targets" in notes[0]


def tinygpt(tmp_path: Path, name: str, **changes: Any) -> TrainConfig:
    return TrainConfig(**{**dict(model="tinygpt", data="usermodels:padded_tokens", batch_size=32, epochs=1,
                                 max_steps=3, optimizer="sgd", lr=0.5, progress=False, tensorboard=False,
                                 device="cpu", checkpoints=False, out=str(tmp_path / name)),
                          **changes}).validate()


def steps(cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each step's loss as the micro-batches report it (read after the step), and the final weights."""
    run = build_run(cfg, CPU)
    run.model.train()
    run.loader.set_epoch(0)
    losses = []
    for micro_batches in steps_of(run.loader):
        kept, _ = train_step(run, micro_batches, Observer())
        sizes = [len(batch) for batch in micro_batches]
        losses.append(sum(float(loss) * n for loss, n in zip(kept, sizes)) / sum(sizes))
        if len(losses) == cfg.optim.max_steps:
            break
    return losses, {k: v.clone() for k, v in run.model.state_dict().items()}


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    scale = max(v.abs().max().item() for v in a.values() if v.is_floating_point())
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point()) / scale


def test_micro_batches_over_padding_train_what_the_whole_batch_does(tmp_path: Path) -> None:
    whole_losses, whole = steps(tinygpt(tmp_path, "whole"))
    # 4 micro-batches of 8 samples, or 2 of 16: different counts of real targets each.
    for changes in ({"accumulate": 4}, {"accumulate": 2}):
        losses, split = steps(tinygpt(tmp_path, "split", **changes))
        assert relative(whole, split) < 1e-6, changes
        # What the step reports is the mean over the step's real targets, however it was cut.
        assert losses == pytest.approx(whole_losses, rel=1e-6), changes
    # The first step's loss is the mean over the batch's real targets of the model as built.
    cfg = tinygpt(tmp_path, "check")
    run = build_run(cfg, CPU)
    batch = next(iter(run.loader))
    x, y = batch
    with torch.no_grad():
        mean = F.cross_entropy(run.model(x).flatten(0, 1), y.flatten())   # ignore_index -100: the real ones
    assert whole_losses[0] == pytest.approx(float(mean), rel=1e-6)


def test_without_padding_nothing_is_counted(tmp_path: Path) -> None:
    run = build_run(tinygpt(tmp_path, "tokens", data="tokens", n_samples=96, seq_len=16, vocab_size=64), CPU)
    assert run.count is None


def hf(tmp_path: Path, name: str, **changes: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    cfg = TrainConfig(**{**dict(model="hfmodels:gpt2_tiny", data="hfmodels:lm_data_padded", batch_size=32, epochs=1,
                                max_steps=2, optimizer="sgd", lr=0.1, progress=False, tensorboard=False,
                                device="cpu", checkpoints=False, out=str(tmp_path / name)),
                         **changes}).validate()
    lines: list[str] = []
    result = train(cfg, CPU, log=lines.append)
    assert result.run_dir is not None
    return torch.load(result.run_dir / "model.pt", weights_only=True), lines


@needs_transformers
def test_a_hugging_face_causal_lm_is_told_the_count(tmp_path: Path) -> None:
    whole, lines = hf(tmp_path, "whole")
    assert any("told num_items_in_batch" in line for line in lines), lines
    split, _ = hf(tmp_path, "split", accumulate=4)
    assert relative(whole, split) < 1e-6
    # scaleloop's own loss on the same tokens (pairs: input, next token) trains the same model.
    pairs, _ = hf(tmp_path, "pairs", data="hfmodels:lm_pairs_padded", accumulate=2)
    assert relative(whole, pairs) < 1e-6


@needs_transformers
def test_a_model_that_ignores_the_count_trains_as_without_counting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ignoring, _ = hf(tmp_path, "ignoring", model="hfmodels:gpt2_ignoring_count", accumulate=2)
    assert "the model's own loss did not follow num_items_in_batch" in capsys.readouterr().out
    import scaleloop.loop.build as build

    monkeypatch.setattr(build, "counting_for", lambda *args: (None, []))
    uncounted, _ = hf(tmp_path, "uncounted", model="hfmodels:gpt2_ignoring_count", accumulate=2)
    assert all(torch.equal(ignoring[k], uncounted[k]) for k in ignoring)
