"""The plan's peak against the CPU allocator's accounting (the profiler): a tiny fsdp run on 2
real Gloo processes (within 10%); a tiny tensor-parallel one with checkpointing against the
same run on a fake process group, whose sums end as they are issued (a peak that is the same
every run: a real group's moves with the scheduling of Gloo's threads)."""
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
def test_the_predicted_peak_of_a_tiny_fsdp_run_is_close(time_limit: None) -> None:
    spec = ModelSpec(seq_len=32, vocab_size=64, d_model=32, n_layers=2, n_heads=4)
    layout = Layout("fsdp", fsdp=2)
    result = measure(spec, layout, batch_size=8, steps=1, warmup=0, timeout_s=60)
    measured = max(result["peaks"])
    predicted = predicted_peak(profile_model(spec), layout, 8)
    assert measured > 0 and len(result["peaks"]) == 2
    assert abs(predicted / measured - 1) <= 0.10, (predicted, measured)


def test_the_predicted_tensor_parallel_peak_lies_in_the_band_a_real_group_reaches(time_limit: None) -> None:
    """The floor: rank 0 on a fake group (no sum in flight). Above it a real Gloo group holds,
    at its peak, up to four finished sums whose buffers Gloo's thread has not yet let go, each
    the MLP's hidden slice of the micro-batch (on these 2 cores, 1.93-2.45 MB over 18 runs of
    this size, the floor and the floor plus four sums). The prediction must lie in that band."""
    spec = ModelSpec(seq_len=32, vocab_size=64, d_model=64, n_layers=2, n_heads=4)
    layout, batch = Layout("fsdp x tp", tp=2, checkpointing=True), 8
    first = measure(spec, layout, batch_size=batch, group="fake")
    again = measure(spec, layout, batch_size=batch, group="fake")
    floor = first["peaks"][0]
    assert floor > 0 and again["peaks"] == first["peaks"]       # the same every run
    profile = profile_model(spec)
    one_sum = batch * spec.seq_len * (4 * spec.d_model // layout.tp) * 4   # TinyGPT's MLP is 4 wide
    predicted = predicted_peak(profile, layout, batch)
    assert floor <= predicted <= floor + 4 * one_sum, (floor, predicted, one_sum)
