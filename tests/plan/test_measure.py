"""The one multi-process check: on 2 CPU processes, the predicted per-rank peak of a tiny fsdp
run is within 10% of the peak measured by the CPU allocator's accounting (the profiler)."""
from __future__ import annotations

import signal
from typing import Any, Iterator

import pytest

from scaleloop.plan.layouts import Layout
from scaleloop.plan.measure import measure
from scaleloop.plan.profile import ModelSpec, profile_model
from scaleloop.plan.validate import predicted_peak

TIME_LIMIT_S = 180


@pytest.fixture
def time_limit() -> Iterator[None]:
    def too_long(signum: int, frame: Any) -> None:
        raise TimeoutError(f"test ran over {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, too_long)   # the launcher stops its workers on any exception
    signal.alarm(TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.distributed
def test_the_predicted_peak_of_a_tiny_fsdp_run_is_within_ten_percent(time_limit: None) -> None:
    spec = ModelSpec(seq_len=32, vocab_size=64, d_model=32, n_layers=2, n_heads=4)
    layout = Layout("fsdp", fsdp=2)
    result = measure(spec, layout, batch_size=8, steps=1, warmup=0, timeout_s=60)
    measured = max(result["peaks"])
    predicted = predicted_peak(profile_model(spec), layout, 8)
    assert measured > 0 and len(result["peaks"]) == 2
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)
