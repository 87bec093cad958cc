"""A slow start-up step says which step it is and where it runs; a quick one says nothing."""
from __future__ import annotations

import sys
import threading

import torch
from torch.utils.data import TensorDataset

from scaleloop.runtime.startwatch import startup_watch, describe

WAIT_S = 30   # far above the watch's delay; the test ends as soon as the line is seen


def slow_user_read(seen: threading.Event) -> None:
    assert seen.wait(WAIT_S), "the watch said nothing"   # SLOW-READ: where the main thread is


def build_data_and_model(seen: threading.Event) -> None:
    """Named as scaleloop's step, but defined here: only scaleloop's own frames name the step."""
    slow_user_read(seen)


def test_a_slow_step_is_named_with_the_users_frame() -> None:
    said: list[str] = []
    seen = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        seen.set()

    with startup_watch(say, after_s=0.01, every_s=60):
        slow_user_read(seen)
    assert len(said) == 1
    line = said[0]
    assert line.startswith("start-up: 0 s so far: starting up (now in slow_user_read, test_startwatch.py:"), line


def test_the_step_comes_from_scaleloops_frames_only() -> None:
    seen, said = threading.Event(), []

    def say(line: str) -> None:
        said.append(line)
        seen.set()

    with startup_watch(say, after_s=0.01, every_s=60):
        build_data_and_model(seen)   # a user's function of that name is not scaleloop's step
    assert "starting up (now in slow_user_read" in said[0], said


CAPTURED: list = []


def factory():   # a --data factory that notes the stack it runs in
    CAPTURED.append(sys._getframe())
    x = torch.randn(16, 4)
    return TensorDataset(x, (x.sum(1) > 0).long())


def test_scaleloops_step_is_named() -> None:
    from scaleloop.config import TrainConfig
    from scaleloop.loop.build import build_data_and_model

    build_data_and_model(TrainConfig(data=f"{__name__}:factory", device="cpu", test_fraction=0.25,
                                     progress=False, tensorboard=False).validate())
    assert describe(CAPTURED[-1]).startswith("reading the data and building the model (now in factory, "
                                             "test_startwatch.py:"), describe(CAPTURED[-1])


def test_a_quick_start_says_nothing() -> None:
    said: list[str] = []
    with startup_watch(said.append, after_s=60):
        pass
    assert said == []
