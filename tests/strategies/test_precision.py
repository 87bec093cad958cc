"""Tests for scaleloop.strategies.precision on the CPU: autocast dtypes and fp16 loss scaling."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scaleloop.errors import UsageError
from scaleloop.strategies.precision import Precision

CPU = torch.device("cpu")


def _forward(precision: Precision) -> torch.Tensor:
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    with precision.autocast():
        return layer(torch.randn(2, 8))


def test_fp32_does_nothing() -> None:
    p = Precision("fp32", CPU)
    assert p.dtype is None and p.scaler is None
    assert _forward(p).dtype == torch.float32
    loss = torch.tensor(2.0)
    assert p.scale(loss) is loss
    assert p.state_dict() == {}


def test_bf16_autocasts_linear_layers() -> None:
    p = Precision("bf16", CPU)
    assert p.dtype == torch.bfloat16 and p.scaler is None
    assert _forward(p).dtype == torch.bfloat16
    # outside the context everything is fp32 again
    assert nn.Linear(8, 4)(torch.randn(2, 8)).dtype == torch.float32


def test_fp16_has_a_scaler_and_autocasts() -> None:
    p = Precision("fp16", CPU)
    assert p.dtype == torch.float16
    assert isinstance(p.scaler, torch.amp.GradScaler)
    assert _forward(p).dtype == torch.float16
    loss = torch.tensor(1.0)
    assert float(p.scale(loss)) == pytest.approx(p.scaler.get_scale())
    assert p.scaler.get_scale() > 1


@pytest.mark.parametrize("name", ["fp64", "FP32", "", "half"])
def test_bad_name(name: str) -> None:
    with pytest.raises(UsageError, match="is not one of: fp32, bf16, fp16"):
        Precision(name, CPU)


def test_fp16_on_mps_is_refused() -> None:
    with pytest.raises(UsageError, match="MPS"):
        Precision("fp16", torch.device("mps"))


def _step_with_grads(p: Precision, fill: float | None) -> tuple[bool, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    before = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with p.autocast():
        # scaled down: at the initial scale 2**16 a bias gradient of 1 would overflow fp16
        loss = 0.1 * model(torch.randn(3, 4)).float().mean()
    p.scale(loss).backward()
    if fill is not None:
        for param in model.parameters():
            param.grad.fill_(fill)
    return p.step(opt), model, before


def test_fp16_step_is_skipped_when_gradients_are_inf() -> None:
    p = Precision("fp16", CPU)
    scale = p.scaler.get_scale()
    stepped, model, before = _step_with_grads(p, float("inf"))
    assert bool(stepped) is False
    assert torch.equal(model.weight.detach(), before)  # the optimizer did not touch the weights
    assert p.scaler.get_scale() < scale                # and the scale was lowered


def test_fp16_step_is_taken_with_finite_gradients() -> None:
    p = Precision("fp16", CPU)
    stepped, model, before = _step_with_grads(p, None)
    assert bool(stepped) is True
    assert not torch.equal(model.weight.detach(), before)
    state = p.state_dict()
    assert "scale" in state
    other = Precision("fp16", CPU)
    other.load_state_dict(state)
    assert other.scaler.get_scale() == p.scaler.get_scale()


def test_unscale_gives_the_true_gradients() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    ref = nn.Linear(4, 1)
    model = nn.Linear(4, 1)
    model.load_state_dict(ref.state_dict())
    ref(x).mean().backward()
    p = Precision("fp16", CPU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p.scale(model(x).mean()).backward()  # fp32 forward, scaled backward
    assert not torch.allclose(model.weight.grad, ref.weight.grad)
    p.unscale_(opt)
    assert torch.allclose(model.weight.grad, ref.weight.grad)


def test_fp32_step() -> None:
    p = Precision("fp32", CPU)
    stepped, model, before = _step_with_grads(p, None)
    assert bool(stepped) is True and not torch.equal(model.weight.detach(), before)
