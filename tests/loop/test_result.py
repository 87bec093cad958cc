"""scaleloop.loop.result.RunningLoss: deferred loss sums equal per-step float64 additions, bit for bit."""
from __future__ import annotations

import random

import torch

from scaleloop.loop.result import RunningLoss, _products_on_device, _products_on_host


def test_sums_equal_per_step_float64_additions_bit_for_bit() -> None:
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    running = RunningLoss()
    ref = torch.zeros(4, dtype=torch.float64)   # what the loop used to do after every micro-batch
    for step in range(1, 200):
        loss = torch.rand((), generator=g) * 3
        n = rng.choice([1, 7, 64, 128, 129])
        running.add(loss, n)
        contrib = torch.stack([loss.double() * n, torch.tensor(float(n), dtype=torch.float64)])
        ref[0:2] += contrib
        ref[2:4] += contrib
        if step % 10 == 0:   # a log row reads and resets the window
            assert running.window_values() == ref[2:4].tolist()
            running.new_window()
            ref[2:4] = 0
        if step % 37 == 0:   # a checkpoint reads everything
            assert running.state(torch.device("cpu")).tolist() == ref.tolist()
    assert running.epoch_sums(torch.device("cpu")).tolist() == ref[0:2].tolist()


def test_load_continues_from_a_checkpoint_state() -> None:
    a = RunningLoss()
    for i in range(5):
        a.add(torch.tensor(0.1 * (i + 1)), 10)
    state = a.state(torch.device("cpu"))
    b = RunningLoss()
    b.load(state)
    for r in (a, b):
        r.add(torch.tensor(0.7), 3)
    assert a.state(torch.device("cpu")).tolist() == b.state(torch.device("cpu")).tolist()
    b.new_epoch()
    assert b.epoch_sums(torch.device("cpu")).tolist() == [0.0, 0.0]


def test_host_and_device_products_are_the_same_numbers() -> None:
    g = torch.Generator().manual_seed(1)
    losses = [torch.rand((), generator=g) * 5 for _ in range(50)]
    counts = [int(c) for c in torch.randint(1, 4096, (50,), generator=g)]
    expected = [float(loss.double() * c) for loss, c in zip(losses, counts)]
    assert _products_on_host(losses, counts) == expected == _products_on_device(losses, counts)
