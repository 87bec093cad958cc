"""Start-up that takes long says what it is doing.

Before the first step a run reads its data, builds the model, makes it parallel, builds the
optimizer and may restore a checkpoint. Each is quick for the built-in workloads; with a
user's dataset or a large model one can take minutes, with nothing on the screen. While
:func:`startup_watch` is open, a thread looks at the main thread's stack once start-up has
taken ``after_s`` seconds, and every ``every_s`` after, and says which step runs and where::

    start-up: 12 s so far: reading the data and building the model (now in CharWindows.__getitem__, charcorpus.py:30)

It reads the stack only (``sys._current_frames``): nothing in the steps changes, and a run whose
start-up is quick prints nothing.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Callable, Iterator

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


@contextlib.contextmanager
def startup_watch(say: Callable[[str], None], after_s: float = 5.0, every_s: float = 15.0) -> Iterator[None]:
    """While open, says (``say``) what start-up is doing once it is slow (module docstring)."""
    main, done, start = threading.get_ident(), threading.Event(), time.perf_counter()

    def watch() -> None:
        wait = after_s
        while not done.wait(wait):
            frame = sys._current_frames().get(main)
            if frame is None:
                return
            say(f"start-up: {time.perf_counter() - start:.0f} s so far: {describe(frame)}")
            wait = every_s

    thread = threading.Thread(target=watch, name="scaleloop-startwatch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


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

