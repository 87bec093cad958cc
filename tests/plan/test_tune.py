"""Batch-size search: the search with fake trials, the real step probe with a fake out-of-memory
error (both on the CPU), the CPU refusal, the report text, and a real run on a CUDA GPU."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import scaleloop.plan.tune as tune
from scaleloop.data.batching import check_batch_split
from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.commands.tune_batch import format_report, tune_batch_command
from scaleloop.plan.tune import (BatchSearch, StepProbe, Trial, TuneReport, find_max_batch, is_out_of_memory,
                                 search_max_batch)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fits_up_to(limit: int):
    return lambda batch: batch <= limit


# --- the search ---------------------------------------------------------------------------

def test_doubles_then_binary_searches_to_the_exact_limit() -> None:
    result = search_max_batch(fits_up_to(300), max_batch=10_000)
    tried = [t.batch for t in result.trials]
    assert result.max_batch == 300 and not result.capped
    assert tried[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # doubling up to the first failure
    assert all(256 < b < 512 for b in tried[10:])                 # then only between 256 and 512
    assert all(t.fits == (t.batch <= 300) for t in result.trials)
    assert len(tried) == len(set(tried)) and len(tried) <= 10 + 8  # each size once; log2(256) halvings
    assert {300, 301} <= set(tried)  # pinned down by a fit and a failure next to each other


@pytest.mark.parametrize("limit", [1, 2, 3, 255, 256, 257, 1000, 4095, 65535])
def test_finds_every_limit(limit: int) -> None:
    assert search_max_batch(fits_up_to(limit)).max_batch == limit


def test_cap_stops_the_doubling() -> None:
    result = search_max_batch(fits_up_to(10**9), max_batch=1000)
    assert result.max_batch == 1000 and result.capped and result.cap == 1000
    assert [t.batch for t in result.trials][-2:] == [512, 1000]


def test_cap_that_does_not_fit_is_searched_below() -> None:
    result = search_max_batch(fits_up_to(700), max_batch=1000)
    assert result.max_batch == 700 and not result.capped


def test_start_above_the_limit_backs_off() -> None:
    result = search_max_batch(fits_up_to(300), start=1024, max_batch=4096)
    assert result.trials[0] == Trial(1024, False)
    assert result.max_batch == 300


def test_not_even_one_fitting_is_a_one_line_usage_error() -> None:
    with pytest.raises(UsageError, match="not even a per-device batch of 1 fits") as info:
        search_max_batch(fits_up_to(0), device_name="cuda:0 (Test GPU)")
    assert "\n" not in str(info.value) and "cuda:0 (Test GPU)" in str(info.value)


@pytest.mark.parametrize("start,cap", [(0, 10), (5, 4)])
def test_bad_bounds(start: int, cap: int) -> None:
    with pytest.raises(ValueError):
        search_max_batch(fits_up_to(3), start=start, max_batch=cap)


def test_global_batch_is_one_the_cli_accepts() -> None:
    found = BatchSearch(max_batch=300, trials=(), capped=False, cap=1000)
    assert found.global_batch() == 300
    assert found.global_batch(4, 2) == 2400 and check_batch_split(2400, 4, 2) == 300
    assert found.global_batch(4, 2, multiple_of=8) == 296 * 8  # per device rounded down to 296
    small = BatchSearch(max_batch=5, trials=(), capped=False, cap=1000)
    assert small.global_batch(2, 1, multiple_of=8) == 10  # no multiple of 8 fits: keep 5


# --- out of memory --------------------------------------------------------------------------

def test_is_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 9 GB)"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


class Greedy(nn.Module):
    """Runs out of (pretend) memory above ``limit`` samples, or fails otherwise if told to."""

    def __init__(self, limit: int, error: type[Exception] = torch.OutOfMemoryError) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.limit = limit
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if x.shape[0] > self.limit:
            raise self.error("CUDA out of memory (pretend)")
        return out


def make_sample(made: list):
    def sample(batch: int):
        x = torch.randn(batch, 4)
        made.append(weakref.ref(x))
        return x, torch.zeros(batch, dtype=torch.long)

    return sample


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def test_step_probe_turns_out_of_memory_into_a_failed_try() -> None:
    model = Greedy(300)
    before = model.lin.weight.detach().clone()
    made: list = []
    probe = StepProbe(model, torch.optim.SGD(model.parameters(), lr=0.1), make_sample(made), ce, torch.device("cpu"))
    assert probe(300) and not probe(301)
    assert not torch.equal(model.lin.weight, before)  # real optimizer steps were taken
    assert all(p.grad is None for p in model.parameters())
    assert all(ref() is None for ref in made)  # nothing from a failed try stays alive
    assert search_max_batch(probe, max_batch=4096).max_batch == 300


def test_step_probe_lets_other_errors_through() -> None:
    model = Greedy(8, error=ValueError)
    probe = StepProbe(model, torch.optim.SGD(model.parameters(), lr=0.1), make_sample([]), ce, torch.device("cpu"))
    with pytest.raises(ValueError):
        search_max_batch(probe)


def test_find_max_batch_restores_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend the CPU is an accelerator to run the whole composition here.
    monkeypatch.setattr(tune, "require_accelerator", lambda device: None)
    model = Greedy(300).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = find_max_batch(model, torch.utils.data.TensorDataset(torch.randn(50, 4), torch.zeros(50, dtype=torch.long)),
                            "cpu", loss=ce, max_batch=4096)
    assert result.max_batch == 300 and all(t.peak_bytes is None for t in result.trials)
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- CPU refusal and the command's text -------------------------------------------------------------

def test_cpu_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as info:
        find_max_batch(nn.Linear(2, 2), lambda b: (torch.randn(b, 2), torch.randn(b, 2)), "cpu")
    message = str(info.value)
    assert "\n" not in message and "accelerators" in message and "pick --batch-size by hand" in message
    with pytest.raises(UsageError, match="accelerators"):
        tune_batch_command(TrainConfig().replace(device="cpu"))


def _report(capped: bool, **kw) -> TuneReport:
    trials = (Trial(1, True, 2**20), Trial(2, True, 2**21), Trial(4, False, 2**30), Trial(3, True, 3 * 2**20))
    search = BatchSearch(max_batch=4 if capped else 3, trials=trials[:2] + (Trial(4, True),) if capped else trials,
                         capped=capped, cap=4)
    return TuneReport(search=search, device="cuda:0 (Test GPU)", train_samples=16, total_bytes=2**31, **kw)


def test_report_text() -> None:
    cfg = TrainConfig().replace(nproc=2, strategy="ddp", accumulate=2)
    text = format_report(cfg, _report(False, workers=2, accumulate=2))
    assert "cuda:0 (Test GPU)" in text and "out of memory" in text
    assert "largest per-device batch that fits: 3 (peak 0.00 GiB of 2.00 GiB)" in text
    assert "use --batch-size 12 (= 2 worker(s) x 2 accumulation step(s) x 3 per device)" in text
    assert "headroom" in text  # DDP's buckets were not measured
    capped = format_report(TrainConfig(), _report(True, workers=1, accumulate=1))
    assert "memory does not limit the batch" in capped and "--batch-size up to 4" in capped


# --- for real, on a GPU -----------------------------------------------------------------------

@needs_cuda
def test_real_search_on_cuda_finds_the_memory_limit() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(device)
    # Cap this process at ~1 GiB so that a small MLP runs out at a batch of a few thousand.
    torch.cuda.set_per_process_memory_fraction(min(1.0, 2**30 / total), device)
    try:
        def factory() -> nn.Module:
            return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                 nn.Linear(4096, 10))

        def sample(batch: int):
            return torch.randn(batch, 1024), torch.randint(0, 10, (batch,))

        result = find_max_batch(factory, sample, device, loss=ce, max_batch=1 << 16)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert not result.capped and result.max_batch >= 1
    by_batch = {t.batch: t for t in result.trials}
    assert by_batch[result.max_batch].fits and not by_batch[result.max_batch + 1].fits
    assert any(not t.fits for t in result.trials[:20])
    assert all(t.peak_bytes is not None for t in result.trials)
    assert by_batch[result.max_batch].peak_bytes <= 2**30
    torch.cuda.empty_cache()
    # The model (~84 MB), its gradients and AdamW state (~250 MB) and the activations are
    # gone; what may stay is cuBLAS's workspace, which torch keeps per handle.
    assert torch.cuda.memory_allocated(device) <= baseline + 64 * 2**20


@needs_cuda
def test_tune_batch_command_on_cuda() -> None:
    text = tune_batch_command(TrainConfig().replace(device="cuda", model="simplenet", data="digits"))
    assert "simplenet on digits" in text and "fits" in text
    # the digits set is tiny: the whole training set fits in one per-device batch
    assert "memory does not limit the batch" in text
