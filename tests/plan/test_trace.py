"""The traced live bytes equal the CPU allocator's own count (the profiler's), on real tensors."""
from __future__ import annotations

import torch
from torch import nn

from scaleloop.models import TinyGPT
from scaleloop.plan.trace import trace_step
from scaleloop.strategies.recompute import peak_step_bytes


def _model_and_step() -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4)
    tokens = torch.randint(0, 64, (4, 32))

    def forward_loss() -> torch.Tensor:
        return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    return model, tokens, forward_loss


def test_the_trace_of_a_real_step_peaks_where_the_allocator_does() -> None:
    model, tokens, forward_loss = _model_and_step()
    series = trace_step(model, forward_loss, [tokens])
    grads = sum(p.grad.numel() * 4 for p in model.parameters())
    model.zero_grad(set_to_none=True)
    measured = peak_step_bytes(lambda: forward_loss().backward())
    assert series.peak == measured
    # Every gradient is alive at the end, and nothing else the step made.
    assert series.grads[-1] == grads and series.other[-1] == 0
    # The forward keeps its activations; the parameters are not counted (a weight's transpose is a view).
    assert 0 < series.saved < series.peak


def test_fake_tensors_trace_the_same_bytes_as_real_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, tokens, forward_loss = _model_and_step()
    real = trace_step(model, forward_loss, [tokens])
    model.zero_grad(set_to_none=True)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_model = TinyGPT(vocab_size=64, seq_len=32, d_model=32, n_layers=2, n_heads=4)
        fake_tokens = mode.from_tensor(tokens)

        def fake_loss() -> torch.Tensor:
            return nn.functional.cross_entropy(fake_model(fake_tokens).flatten(0, 1), fake_tokens.flatten())
        fake = trace_step(fake_model, fake_loss, [fake_tokens])
    assert fake.saved == real.saved
    assert abs(fake.peak - real.peak) <= 0.01 * real.peak
