"""Start-up that takes long says what it is doing.

Before the first step a run reads its data, builds the model, makes it parallel, builds the
optimizer and may restore a checkpoint. Each is quick for the built-in workloads; with a
user's dataset or a large model one can take minutes, with nothing on the screen. While
:class:`StartupWatch` is open, a thread looks at the main thread's stack once start-up has
taken ``after_s`` seconds, and every ``every_s`` after, and says which step runs and where::

    start-up: 12 s so far: reading the data and building the model (now in CharWindows.__getitem__, charcorpus.py:30)

It reads the stack only (``sys._current_frames``): nothing in the steps changes, and a run whose
start-up is quick prints nothing.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Callable, Optional

#: scaleloop's start-up functions, innermost first, and the step each is, in words.
STEPS = (
    ("build_optimizer", "building the optimizer"),
    ("setup", "making the model parallel (the strategy)"),
    ("build_strategy", "building the strategy"),
    ("build_data_and_model", "reading the data and building the model"),
    ("restore", "restoring the checkpoint"),
    ("build_run", "building the run"),
)
_PACKAGE = str(Path(__file__).resolve().parents[1])


class StartupWatch:
    """A context manager: says (``say``) what start-up is doing once it is slow (module docstring)."""

    def __init__(self, say: Callable[[str], None], after_s: float = 5.0, every_s: float = 15.0) -> None:
        self.say, self.after_s, self.every_s = say, after_s, every_s
        self._main = threading.get_ident()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = 0.0

    def __enter__(self) -> "StartupWatch":
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._watch, name="scaleloop-startwatch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        wait = self.after_s
        while not self._done.wait(wait):
            frame = sys._current_frames().get(self._main)
            if frame is None:
                return
            elapsed = time.perf_counter() - self._start
            self.say(f"start-up: {elapsed:.0f} s so far: {describe(frame)}")
            wait = self.every_s


def describe(frame: FrameType) -> str:
    """The start-up step ``frame`` (the innermost of a stack) is in, and the code it is running."""
    names, innermost, user = [], frame, None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE):   # (a user's own function named "setup" is not a step)
            names.append(frame.f_code.co_name)
        if user is None and _is_users(path):
            user = frame
        frame = frame.f_back  # type: ignore[assignment]
    step = next((words for name, words in STEPS if name in names), "starting up")
    shown = user or innermost
    qualname = getattr(shown.f_code, "co_qualname", shown.f_code.co_name)
    where = f"{qualname}, {Path(shown.f_code.co_filename).name}:{shown.f_lineno}"
    return f"{step} (now in {where})"


def _is_users(path: str) -> bool:
    """Code of the user's own (not scaleloop's, torch's, an installed package's or Python's)."""
    return not (path.startswith(_PACKAGE) or "site-packages" in path or "dist-packages" in path
                or path.startswith(sys.prefix) or path.startswith(sys.base_prefix) or path.startswith("<"))

