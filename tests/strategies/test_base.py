"""``total_norm``, the gradient norm every strategy's ``grad_norm`` starts from, is
``torch.nn.utils.get_total_norm`` bit for bit: on its own fast path and on the cases it hands on."""
from __future__ import annotations

import pytest
import torch

from scaleloop.strategies.base import total_norm


def _grads(*shapes_and_dtypes: tuple[tuple[int, ...], torch.dtype]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(shape, generator=gen) * 3).to(dtype) for shape, dtype in shapes_and_dtypes]


CASES = {
    "one dtype (the fast path)": _grads(((128, 64), torch.float32), ((128,), torch.float32),
                                        ((10, 128), torch.float32), ((10,), torch.float32)),
    "bf16": _grads(((33, 7), torch.bfloat16), ((5,), torch.bfloat16)),
    "an empty tensor among them": _grads(((0,), torch.float32), ((4, 4), torch.float32)),
    "mixed dtypes (handed on)": _grads(((8, 8), torch.float32), ((8,), torch.float64)),
    "one tensor": _grads(((1000,), torch.float32)),
    "none": [],
}


@pytest.mark.parametrize("name", CASES)
def test_total_norm_is_get_total_norm_bitwise(name: str) -> None:
    grads = CASES[name]
    ours, theirs = total_norm(grads), torch.nn.utils.get_total_norm(grads)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours, theirs), (ours.item(), theirs.item())


def test_a_gradient_that_requires_grad_is_handed_on_and_builds_no_graph() -> None:
    grads = [torch.randn(3, 3, requires_grad=True), torch.randn(3)]
    norm = total_norm(grads)
    assert not norm.requires_grad
    assert torch.equal(norm, torch.nn.utils.get_total_norm(grads))
