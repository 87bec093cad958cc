"""Which frames of a stack are the user's, and where a rank was in the loop; no torch here.

Shared by the worker (which records its exception) and the launcher (which reads a stuck
rank's stack dump), so that both name "the user's code" the same way: the innermost frame that
is not torch's, not scaleloop's and not Python's own library. A DataLoader worker process's
exception reaches its rank as text: :func:`worker_traceback` reads its frames and its sample back.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

# The attribute the training loop sets on an exception that leaves it: {"epoch": E, "step": S}.
WHERE_ATTR = "scaleloop_where"


def note_where(exc: BaseException, epoch: Optional[int], step: int, last_progress: Optional[float] = None,
               during: Optional[str] = None) -> None:
    """Attach where the loop was (1-based epoch, global step in progress) to ``exc``.

    ``epoch`` None: a loop that counts steps only (``scaleloop verify``). ``last_progress``: the
    wall-clock time the loop last moved on (its last step's end), for recovery times. ``during``:
    what the loop was doing when not a training step ("the evaluation after epoch 1", "writing
    the checkpoint of step 12", "start-up: reading the data and building the model"). The first
    note wins: an exception re-raised through an outer loop keeps the inner place.
    """
    if getattr(exc, WHERE_ATTR, None) is None:
        try:
            setattr(exc, WHERE_ATTR, {"epoch": None if epoch is None else int(epoch), "step": int(step),
                                      "last_progress": last_progress, "during": during})
        except (AttributeError, TypeError):  # an exception type that takes no attributes
            pass


def where_of(exc: BaseException) -> dict[str, Optional[int]]:
    """The epoch and step noted on ``exc`` or on an exception it was raised from (else None)."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        where = getattr(current, WHERE_ATTR, None)
        if isinstance(where, dict):
            return {"epoch": where.get("epoch"), "step": where.get("step"), "last_progress": where.get("last_progress"),
                    "during": where.get("during")}
        current = current.__cause__ or current.__context__
    return {"epoch": None, "step": None, "last_progress": None, "during": None}


@dataclass(frozen=True)
class Frame:
    """One frame of a stack: file, line and function."""

    path: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.name}"


def _package_dir(name: str) -> Optional[str]:
    """The directory of an importable package, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.realpath(locations[0]) + os.sep if locations else None


class FrameKinds:
    """Tells torch's, scaleloop's and Python's own files from the user's (built once per use)."""

    def __init__(self) -> None:
        self.torch = _package_dir("torch")
        self.scaleloop = os.path.realpath(Path(__file__).resolve().parents[1]) + os.sep
        paths = sysconfig.get_paths()
        self.stdlib = tuple(os.path.realpath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths)

    def kind(self, path: str) -> str:
        """``torch``, ``scaleloop``, ``python`` (the standard library, frozen modules) or ``user``."""
        if path.startswith("<"):
            return "python"
        real = os.path.realpath(path)
        if self.torch and real.startswith(self.torch):
            return "torch"
        if real.startswith(self.scaleloop):
            return "scaleloop"
        if "site-packages" not in real and "dist-packages" not in real and real.startswith(self.stdlib):
            return "python"
        return "user"

    def innermost_user(self, frames: Iterable[Frame]) -> Optional[Frame]:
        """The innermost user frame of ``frames`` (outermost first); else scaleloop's; else the last."""
        listed = list(frames)
        for wanted in ("user", "scaleloop"):
            found = [f for f in listed if self.kind(f.path) == wanted]
            if found:
                return found[-1]
        return listed[-1] if listed else None


# How torch raises again, in the process that asked for a batch, an exception of one of its
# DataLoader worker processes: "Caught <Type> in DataLoader worker process <N>.", then the
# worker's own traceback as text ("Original Traceback (most recent call last): ...").
_CAUGHT = re.compile(r"^Caught (?P<type>[\w.]+) (?P<where>in DataLoader worker process \d+)\.\s*$")
_TB_FRAME = re.compile(r'^\s+File "(?P<path>.+)", line (?P<line>\d+), in (?P<name>.+?)\s*$')
# The note scaleloop's DataLoader path adds with the index the dataset was asked for (data.loader).
_SAMPLE_NOTE = "scaleloop: while reading sample "


def noted_sample(exc: BaseException) -> Optional[str]:
    """The sample index data.loader noted on ``exc`` (raised in this process), or None."""
    notes = getattr(exc, "__notes__", None) or ()
    return next((note[len(_SAMPLE_NOTE):].strip() for note in notes
                 if isinstance(note, str) and note.startswith(_SAMPLE_NOTE)), None)


@dataclass(frozen=True)
class WorkerTraceback:
    """A DataLoader worker's exception, read from the text torch raised it again with."""

    where: str                  # "in DataLoader worker process 0"
    error_type: Optional[str]   # the worker's exception's type
    message: str                # and its message (first line)
    frames: tuple[Frame, ...]   # the worker's stack, outermost first
    sample: Optional[str]       # the index of the sample it was reading, when noted

    def described(self) -> str:
        """The message, with where it was raised and the sample it read:
        ``bad value (in DataLoader worker process 0, reading sample 12)``."""
        reading = f", reading sample {self.sample}" if self.sample is not None else ""
        return f"{self.message} ({self.where}{reading})"


def worker_traceback(message: str) -> Optional[WorkerTraceback]:
    """The DataLoader worker's exception that ``message`` carries (None: it is not one)."""
    lines = message.splitlines()
    caught = _CAUGHT.match(lines[0]) if lines else None
    if caught is None:
        return None
    # The last traceback in the text (a chained exception prints those before it first).
    starts = [i for i, line in enumerate(lines) if line.endswith("Traceback (most recent call last):")]
    if not starts:
        return None
    frames: list[Frame] = []
    i = starts[-1] + 1
    while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
        found = _TB_FRAME.match(lines[i])
        if found:
            frames.append(Frame(found["path"], int(found["line"]), found["name"]))
        i += 1
    rest = lines[i:]
    error_type, _, text = (rest[0] if rest else "").partition(": ")
    sample = next((line[len(_SAMPLE_NOTE):].strip() for line in rest if line.startswith(_SAMPLE_NOTE)), None)
    return WorkerTraceback(caught["where"], error_type.rpartition(".")[2] or caught["type"], text.strip(),
                           tuple(frames), sample)
