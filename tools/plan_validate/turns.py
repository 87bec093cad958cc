"""Step times of several layouts measured in turns, in one process group (the plan's check of
its step order, :mod:`plan_validate.validate`).

Timed one launch after the other, the same layout's step on this shared 2-core VM read 432 ms
in one launch and 256 ms in the next: the machine's speed drifts over minutes, and one launch
per layout orders the layouts by when they ran. Here every layout is built once on the same
processes, and the rounds visit them in turn (the order rotated each round, so that none always
follows the same one): each visit runs one step untimed (the caches warm again after the
previous layout's) and one timed between two barriers. A layout's time is the median over the
rounds, and two layouts' order counts as measured only where most rounds put them alike
(:func:`pair_agreement`): a drift then slows both of a pair alike.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict
from typing import Any, Sequence

from scaleloop.plan.layouts import Layout
from scaleloop.plan.profile import ModelSpec


def turns_worker(spec: dict[str, Any], layouts: list[dict[str, Any]], batch_size: int, rounds: int,
                       timeout_s: float) -> list[list[float]]:
    """One rank's part: every layout built, then ``rounds`` rounds of one untimed and one timed
    step each; the timed seconds per layout (rank 0's, between barriers)."""
    from scaleloop.plan.stepping import build_run, token_dataset
    from scaleloop.runtime.collectives import barrier
    from scaleloop.runtime.dist import DistEnv, init_process_group

    env = DistEnv.from_env(timeout_s=timeout_s)
    init_process_group(env)
    model_spec = ModelSpec(**spec)
    dataset = token_dataset(model_spec, batch_size)
    runs = [_Run(build_run(model_spec, Layout(**layout), env, dataset, batch_size)) for layout in layouts]
    for run in runs:
        run.step()   # the optimizer's state and the strategies' first-step work, untimed
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i in [(r + k) % len(runs) for k in range(len(runs))]:
            runs[i].step()
            barrier(env)
            t0 = time.perf_counter()
            runs[i].step()
            barrier(env)
            times[i].append(time.perf_counter() - t0)
    return times


class _Run:
    """One layout's model, optimizer, strategy and loader, stepping through its batches round
    and round."""

    def __init__(self, built: tuple[Any, Any, Any, Any]) -> None:
        self.model, self.optimizer, self.strategy, self.loader = built
        self.batches = iter(self.loader)

    def step(self) -> None:
        from scaleloop.plan.stepping import lm_loss

        batch = next(self.batches, None)
        if batch is None:
            self.batches = iter(self.loader)
            batch = next(self.batches)
        self.strategy.forward_backward(self.model, batch, lm_loss)
        self.strategy.optimizer_step(self.optimizer)


def time_in_turns(spec: ModelSpec, layouts: Sequence[Layout], batch_size: int, rounds: int = 10,
                  timeout_s: float = 300) -> list[list[float]]:
    """Each layout's step seconds, one per round, all measured in turns on the same processes
    (every layout must have the same number of ranks)."""
    from scaleloop.launching.spawn import launch

    worlds = {layout.world for layout in layouts}
    if len(worlds) != 1:
        raise ValueError(f"layouts timed in turns share their processes: ranks {sorted(worlds)} differ")
    return launch(turns_worker, worlds.pop(), threads=1,
                  args=(asdict(spec), [asdict(layout) for layout in layouts], batch_size, rounds, timeout_s))


def median_s(times: Sequence[float]) -> float:
    """A layout's step time: the median of its rounds."""
    return statistics.median(times)


def pair_agreement(a: Sequence[float], b: Sequence[float]) -> float:
    """Of the rounds, the share in which the same one of two layouts was the faster (0.5 to 1; 1:
    every round ordered them alike). Rounds are paired: both layouts ran within seconds."""
    faster = sum(x < y for x, y in zip(a, b))
    n = min(len(a), len(b))
    return max(faster, n - faster) / n if n else 0.0
