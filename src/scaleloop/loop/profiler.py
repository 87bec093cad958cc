"""Profiling steps with ``torch.profiler``: ``scaleloop train --profile N`` and ``scaleloop.profile``.

:class:`Profiler` is an :class:`~scaleloop.loop.step.Observer` around another one (the trainer):
it passes every call on, and while it records it opens and closes ``record_function`` ranges at
the step's points (``scaleloop.step``, ``.data``, ``.forward_backward``, ``.optimizer``), which
``output.profile_trace`` reads back from the trace with the trace's own operators. It changes
nothing in the step: a profiled run trains the same weights.

After ``warmup`` steps it records ``steps`` steps; then each rank writes its trace
(``<run>/profile/rank-R.pt.trace.json``); :meth:`Profiler.report` (after the loop) gathers every
rank's numbers on rank 0, which writes ``summary.json`` and ``timeline.png`` and prints the
table. Only ``--profile`` makes one: off, this module is not imported.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from scaleloop.data.loader import Batch
from scaleloop.loop.step import Observer
from scaleloop.loop.text import Log
from scaleloop.output.profile_summary import PROFILE_DIR, TIMELINE_FILE, combine, lines, trace_name, write
from scaleloop.output.profile_trace import analyse
from scaleloop.output.settings import PROFILE_WARMUP
from scaleloop.runtime.collectives import broadcast_object, gather_object
from scaleloop.runtime.dist import DistEnv

#: Steps run before the profiler records (``--profile``'s, from its declaration).
WARMUP_STEPS = PROFILE_WARMUP
#: Kineto (the profiler's C++ side) writes its log straight to the process's stderr, below Python:
#: "USDT:... profiler_start" and "profiler_stop" at every start and stop, at its highest severity
#: (5). One above it keeps all of its lines off the console and the rank logs. Kineto reads the
#: variable once, when a process first profiles; a value the user set is kept.
KINETO_QUIET = "6"


class Profiler(Observer):
    """Records ``steps`` steps after ``warmup`` into ``out_dir`` (every rank's own directory, the
    same on a shared file system), watching for ``inner`` (which it passes every call on to).

    ``auto_data``: whether the time between steps is ``data wait`` (the trainer's loop: the next
    batch is fetched there); a hand-written loop marks its parts with :meth:`phase`.
    """

    def __init__(self, out_dir: Path, env: DistEnv, steps: int, *, warmup: int = WARMUP_STEPS,
                 inner: Optional[Observer] = None, say: Log = print, auto_data: bool = False,
                 about: Optional[dict[str, Any]] = None) -> None:
        self.out_dir, self.env, self.steps, self.warmup = Path(out_dir), env, steps, warmup
        self.inner = inner if inner is not None else Observer()
        self.say, self.auto_data, self.about = say, auto_data, dict(about or {})
        self.start_step = 0    # the steps taken before this profiler (a resumed run's), for the summary
        self.seen = 0          # steps ended so far
        self.profiled = 0      # of them, recorded
        self.trace: Optional[Path] = None   # this rank's trace, once written
        self._prof: Any = None
        self._ranges: list[tuple[str, Any]] = []   # the open record_function ranges, innermost last
        self._cuda = env.device.type == "cuda" and torch.cuda.is_available()
        if warmup == 0:
            self._start()

    # --- the Observer's points, passed on to ``inner`` ---------------------------------
    def micro_batch(self, batch: Batch) -> None:
        self.inner.micro_batch(batch)
        if self._prof is not None:
            self._phase("scaleloop.forward_backward")

    def forward_done(self, loss: torch.Tensor) -> None:
        self.inner.forward_done(loss)

    def micro_done(self, batch: Batch, loss: Optional[torch.Tensor]) -> None:
        self.inner.micro_done(batch, loss)
        if self._prof is not None:   # between micro-batches the next one is fetched
            self._phase(None if batch.last_micro or not self.auto_data else "scaleloop.data")

    def counted(self, factor: float) -> None:
        self.inner.counted(factor)

    def synced(self) -> None:
        self.inner.synced()
        if self._prof is not None:
            self._phase("scaleloop.optimizer")

    def stepped(self) -> None:
        self.inner.stepped()
        self.step()

    # --- the library's form ----------------------------------------------------------------
    def step(self) -> None:
        """A step ended (after the optimizer step): start recording after the warm-up, stop after
        ``steps`` recorded."""
        self.seen += 1
        if self._prof is not None:
            self._close_all()
            self.profiled += 1
            if self.profiled >= self.steps:
                self._stop()
            else:
                self._open_step()
        elif self.seen == self.warmup and self.trace is None:
            self._start()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a part of a hand-written step: ``data``, ``forward``, ``backward`` or ``optimizer``."""
        if self._prof is None:
            yield
            return
        self._phase(f"scaleloop.{name}")
        try:
            yield
        finally:
            self._phase(None)

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, kind: Any, exc: Optional[BaseException], tb: Any) -> None:
        if exc is not None:
            self.abandon(exc)
        else:
            self.report()

    # --- the end -------------------------------------------------------------------------
    def report(self) -> Optional[dict[str, Any]]:
        """After the last step, on every rank (a collective): the summary, written and printed by
        rank 0 and returned there (None elsewhere, and when no step was recorded)."""
        if self._prof is not None:   # the run ended before all the steps were recorded
            self._close_all()
            self._stop()
        numbers = analyse(self.trace, self.profiled) if self.trace is not None and self.profiled else None
        gathered = gather_object(numbers, self.env)
        if not self.env.is_main:
            return None
        if any(n is None for n in gathered):
            self.say(f"profile: no step recorded (the run ended within the {self.warmup} warm-up steps)")
            return None
        summary = combine(gathered, first_step=self.start_step + self.warmup + 1, **self.about)
        try:
            from scaleloop.output.profile_plot import plot_timeline
            summary["timeline"] = str(plot_timeline(summary, self.out_dir / TIMELINE_FILE))
        except ImportError:
            self.say("profile: no timeline.png: it needs matplotlib (pip install matplotlib)")
        write(self.out_dir, summary)
        for line in lines(summary, self.out_dir):
            self.say(line)
        return summary

    def abandon(self, exc: BaseException) -> None:
        """The run failed: stop recording, keep the trace so far, and on a CUDA out-of-memory error
        while recording dump the allocator's snapshot (``memory-snapshot-rank-R.pickle``, for pytorch.org/memory_viz)."""
        recording = self._prof is not None
        if recording:
            self._close_all()
            self._stop(keep_history=True)
        if recording and self._cuda and isinstance(exc, torch.cuda.OutOfMemoryError):
            self.out_dir.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.out_dir / f"memory-snapshot-rank-{self.env.rank}.pickle"))

    # --- recording -----------------------------------------------------------------------
    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        if self._cuda:   # for a snapshot on an out-of-memory error while profiling (abandon)
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._prof = profile(activities=activities)
        self._prof.start()
        self._open_step()

    def _open_step(self) -> None:
        self._open("scaleloop.step")
        if self.auto_data:
            self._open("scaleloop.data")

    def _stop(self, keep_history: bool = False) -> None:
        prof, self._prof = self._prof, None
        prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace = self.out_dir / trace_name(self.env.rank)
        prof.export_chrome_trace(str(self.trace))
        if self._cuda and not keep_history:   # (kept for the snapshot of a failure)
            torch.cuda.memory._record_memory_history(enabled=None)

    def _phase(self, name: Optional[str]) -> None:
        """Close the open phase (every range above the step's) and open ``name`` (None: none)."""
        while len(self._ranges) > 1:
            self._ranges.pop()[1].__exit__(None, None, None)
        if name is not None and self._ranges:
            self._open(name)

    def _open(self, name: str) -> None:
        span = torch.profiler.record_function(name)
        span.__enter__()
        self._ranges.append((name, span))

    def _close_all(self) -> None:
        while self._ranges:
            self._ranges.pop()[1].__exit__(None, None, None)


def profiler_for(inner: Observer, run: Any, run_dir: Optional[Path], say: Log, start_step: int = 0) -> Profiler:
    """The profiler of ``scaleloop train --profile N``, watching for ``inner`` (the trainer): its
    directory is rank 0's run directory (told to every rank, a collective); ``start_step``: the
    steps a resumed run took before."""
    base = broadcast_object(str(run_dir) if run_dir is not None else ".", run.env)
    about = dict(strategy=run.strategy.name, device=str(run.env.device), model=run.cfg.model_data.model)
    profiler = Profiler(Path(base) / PROFILE_DIR, run.env, run.cfg.output.profile, inner=inner, say=say,
                        auto_data=True, about=about)
    profiler.start_step = start_step
    return profiler


def profile(out_dir: str | Path, steps: int = 3, *, warmup: int = WARMUP_STEPS, env: Optional[DistEnv] = None,
            say: Log = print) -> Profiler:
    """Profile ``steps`` steps of a hand-written loop after ``warmup``, into ``out_dir``::

        with scaleloop.profile("runs/mine/profile", steps=3, env=env) as prof:
            for batch in loader:
                with prof.phase("data"): ...   # optional: mark the parts (data, forward, backward, optimizer)
                ...
                strategy.optimizer_step(optimizer)
                prof.step()

    On leaving the block every rank's numbers are gathered (a collective) and rank 0 writes
    ``summary.json`` and ``timeline.png`` there and prints the table; backward and
    communication are found in the trace whether or not the parts are marked.
    """
    return Profiler(Path(out_dir), env if env is not None else DistEnv(), steps, warmup=warmup, say=say)
