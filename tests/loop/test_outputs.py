"""What a model may return, and the losses and tasks built on it (scaleloop.loop.tasks).

A model that returns its prediction in a tuple, a mapping, or an object with ``logits``
trains to exactly the weights of the same model returning the tensor; a model that computes
its own loss trains on it; anything else stops with one line (and exit 2 from the CLI).
"""
from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaleloop.config import TrainConfig
from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError
from scaleloop.loop.tasks import own_loss, prediction_of, resolve_loss, shape_mismatch
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv

SCRIPTS = Path(__file__).resolve().parents[1] / "distributed" / "scripts"
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
        "from test_outputs import FirstRowOnly, Returning, TakesTargets\n"
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
    res = subprocess.run([sys.executable, "-m", "scaleloop", "train", "--model", "usermodels:Chatty",
                          "--epochs", "1", "--no-progress", "--out", str(tmp_path / "run")],
                         cwd=SCRIPTS, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("scaleloop: error:")]
    assert errors == ["scaleloop: error: the model returned a str; expected a tensor, a tuple or list whose first "
                      "element is the prediction, or a mapping or object with 'logits' (a Hugging Face "
                      "ModelOutput) or with its own 'loss'"], res.stderr
