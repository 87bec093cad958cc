"""FLOPs counted per sample, the GPU peak table, the measured CPU peak and MFU."""
from __future__ import annotations

import pytest
import torch

from scaleloop.bench.flops import gpu_datasheet_peak, measure_matmul_peak, mfu, train_flops_per_sample
from scaleloop.data.info import DataInfo
from scaleloop.models import SimpleNet


def test_flops_of_an_mlp_training_step_are_exact() -> None:
    d_in, hidden, out, batch = 20, 32, 10, 8
    model = SimpleNet(d_in, hidden, out)
    x, y = torch.randn(batch, d_in), torch.randint(0, out, (batch,))
    flops = train_flops_per_sample(model, x, y, DataInfo("t", "classification", (d_in,), out))
    # forward: 2*in*h + 2*h*out; backward: weight grads of both layers (same again), and the
    # input grad of the second layer only (the data needs no gradient).
    assert flops == 2 * d_in * hidden + 2 * hidden * out + 2 * d_in * hidden + 2 * hidden * out + 2 * hidden * out
    assert all(p.grad is None for p in model.parameters())   # counting leaves no gradients behind


@pytest.mark.parametrize("name,precision,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("NVIDIA L4", "fp16", 121e12),
])
def test_gpu_datasheet_peaks(name: str, precision: str, expected: float) -> None:
    peak = gpu_datasheet_peak(name, precision)
    assert peak is not None and peak.flops_per_s == expected


def test_unknown_gpu_has_no_datasheet_peak() -> None:
    assert gpu_datasheet_peak("Imaginary GPU 9000", "bf16") is None


def test_measured_cpu_peak_is_plausible_and_restores_threads() -> None:
    before = torch.get_num_threads()
    peak = measure_matmul_peak(torch.device("cpu"), "fp32", threads=1, size=256, reps=2)
    assert 1e8 < peak < 1e13    # between 0.1 GFLOP/s and 10 TFLOP/s for one core
    assert torch.get_num_threads() == before


def test_mfu_arithmetic() -> None:
    assert mfu(1e6, 1e3, 1e10) == pytest.approx(0.1)
