"""What scaleloop's loop itself costs per optimizer step, piece by piece, in microseconds.

Each piece is timed on its own, many times over, and the fastest of several rounds is kept
(the least disturbed by other work on the machine). Pieces that do torch work are timed
against the same torch work done by hand, so what is left is the bookkeeping:

- ``batch objects``: an epoch from scaleloop's loader (``Batch`` with its place) minus the same
  ``index_select`` calls done by hand, per step;
- ``step calls``: ``train_step`` (strategy, precision, schedule) minus the
  hand-written forward, loss, backward and optimizer step on the same one-weight model;
- ``loss sums``: ``RunningLoss.add`` per step, and its flush at each log row;
- ``schedule``: one ``scheduler.step()``;
- ``gradient norm``: the norm a log row shows (``train_step(..., norm=True)``), taken on the run's
  own model right after a backward as in the loop, every ``log_every`` steps (the raw loop takes none);
- ``log row``: the global loss and a ``metrics.csv`` row, every ``log_every`` steps.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from scaleloop.bench.report import Column, Table

Bench = Callable[[int], None]


def _best_us(fn: Bench, n: int, rounds: int = 7) -> float:
    """Fastest of ``rounds`` timings of ``fn(n)``, in microseconds per iteration."""
    return _best_pair_us(fn, None, n, rounds)[0]


def _extra_us(ours: Bench, raw: Bench, n: int, rounds: int = 9) -> float:
    """What ``ours`` costs beyond ``raw`` per iteration: rounds interleaved, fastest of each kept."""
    a, b = _best_pair_us(ours, raw, n, rounds)
    return a - b


def _best_pair_us(first: Bench, second: Any, n: int, rounds: int) -> tuple[float, float]:
    fns = [first] if second is None else [first, second]
    for fn in fns:
        fn(max(1, n // 10))   # warm caches and lazy initialisation
    best = [float("inf")] * len(fns)
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            start = time.perf_counter()
            fns[i](n)
            best[i] = min(best[i], time.perf_counter() - start)
    us = [1e6 * b / n for b in best]
    return us[0], (us[1] if len(us) > 1 else 0.0)


#: Rounds of each timing in a --quick run (CI-sized: it checks the table is made, not its figures).
QUICK_ROUNDS = 3


def measure_loop_cost(cfg: Any, device: torch.device, quick: bool = False) -> dict[str, Any]:
    """The loop's own cost per step for ``cfg``'s batch and its split (tiny model: bookkeeping only);
    ``quick``: each piece timed over :data:`QUICK_ROUNDS` rounds, not 7 (9 for a difference)."""
    from scaleloop.loop.build import build_run
    from scaleloop.runtime.dist import DistEnv

    run = build_run(cfg.replace(checkpoints=False, tensorboard=False), DistEnv(device=device))
    rounds = QUICK_ROUNDS if quick else None   # None: each timing's own default
    norm = _norm_cost(run, rounds=rounds or 7)   # first: the step's piece below puts a one-weight model in the run
    pieces = {**_batch_cost(run, rounds), **_step_cost(run, rounds), **norm, **_bookkeeping_cost(run, rounds)}
    total = sum(v for k, v in pieces.items() if not k.startswith("  "))
    return {"pieces_us": pieces, "total_us": total, "rounds": rounds or 7}


def _batch_cost(run: Any, rounds: Optional[int] = None) -> dict[str, float]:
    """An epoch of scaleloop's batches against the same ``index_select`` calls by hand, per step."""
    from scaleloop.data.batch import take
    from scaleloop.data.loader import ShardedLoader, tensors_of
    from scaleloop.data.sampler import StepSampler

    dataset, steps = run.data.train, run.loader.sampler.steps_per_epoch
    tensors = tensors_of(dataset)
    if tensors is None or not steps:
        return {}
    sampler = StepSampler(len(dataset), run.cfg.optim.batch_size, seed=run.cfg.optim.seed)
    loader = ShardedLoader(dataset, sampler, run.env.device)
    index_lists = [sampler.step_indices(0, s) for s in range(steps)]

    def ours(n: int) -> None:
        for _ in range(n):
            loader.set_epoch(0)
            for _batch in loader:
                pass

    def raw(n: int) -> None:
        for _ in range(n):
            for idx in index_lists:
                take(tensors, idx)   # one index_select per tensor, as a hand-written loop gathers

    return {"batch objects (epoch split, Batch)": _extra_us(ours, raw, 20, rounds or 9) / steps}


def _step_cost(run: Any, rounds: Optional[int] = None) -> dict[str, float]:
    """``train_step`` around a one-weight model, against the same calls by hand."""
    from scaleloop.loop.build import build_scheduler
    from scaleloop.loop.step import Observer, train_step

    device = run.env.device
    tiny = torch.nn.Linear(1, 1).to(device)
    opt = torch.optim.SGD(tiny.parameters(), lr=0.0)
    x, y = torch.ones(2, 1, device=device), torch.ones(2, 1, device=device)
    mse = torch.nn.functional.mse_loss
    batch = next(iter(run.loader))
    small = type(batch)(x, y, batch.place)
    run.model, run.optimizer, run.loss_fn = tiny, opt, mse
    run.scheduler = build_scheduler(opt, run.cfg.optim, run.total_steps)   # the run's schedule, on this optimizer
    one_step, watch = [small], Observer()

    def ours(n: int) -> None:
        for _ in range(n):
            train_step(run, one_step, watch)

    def raw(n: int) -> None:
        for _ in range(n):
            mse(tiny(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def schedule(n: int) -> None:
        for _ in range(n):
            run.scheduler.step()

    return {"step calls (strategy, precision, schedule)": _extra_us(ours, raw, 2000, rounds or 9),
            "  of which: schedule step": _best_us(schedule, 20000, rounds or 7)}


def _norm_cost(run: Any, calls: int = 200, rounds: int = 7) -> dict[str, float]:
    """The gradient norm of a log row's step, spread over the steps between rows. Timed alone right
    after a backward of the run's model on one of its batches: the loop takes it there, and a norm
    taken on gradients just written costs about twice one taken again (caches)."""
    from scaleloop.data.batch import call_model

    model, strategy = run.model, run.strategy
    x, y = next(iter(run.loader))
    best = float("inf")
    for _ in range(rounds):
        spent = 0.0
        for _ in range(calls):
            run.loss_fn(call_model(model, x), y).backward()
            start = time.perf_counter()
            strategy.grad_norm(model)
            spent += time.perf_counter() - start
            model.zero_grad(set_to_none=True)
        best = min(best, spent / calls)
    return {f"gradient norm (every {run.cfg.output.log_every} steps)": 1e6 * best / run.cfg.output.log_every}


def _bookkeeping_cost(run: Any, rounds: Optional[int] = None) -> dict[str, float]:
    """The running loss sums per step, and a log row spread over the steps between rows."""
    from scaleloop.checkpoint.manager import Checkpointer
    from scaleloop.loop.result import RunningLoss
    from scaleloop.loop.trainer import Trainer

    loss = torch.zeros((), device=run.env.device)
    running = RunningLoss()

    def add(n: int) -> None:
        for _ in range(n):
            running.add(loss, 64)
        running.new_window()

    pieces = {"loss sums": _best_us(add, 2000, rounds or 7)}
    with tempfile.TemporaryDirectory(prefix="scaleloop-loopcost-") as tmp:
        def silent(_msg: str) -> None:
            pass

        # The loop's own log row: the all-reduce, the metrics.csv row and the health checks.
        checkpointer = Checkpointer(run.strategy, run.cfg.checkpointing, {}, seed=run.cfg.optim.seed, say=silent)
        trainer = Trainer(run, checkpointer, silent, time.perf_counter(), run_dir=Path(tmp))
        progress, running = trainer.progress, trainer.running

        def log_rows(n: int) -> None:
            for _ in range(n):
                running.add(loss, 64)
                progress.global_step += 1
                trainer.log_row(0, 64, time.perf_counter())

        pieces[f"log row (every {run.cfg.output.log_every} steps)"] = _best_us(log_rows, 500, rounds or 7) / run.cfg.output.log_every
        if trainer.metrics is not None:
            trainer.metrics.close()
    return pieces


def loop_cost_table(cost: dict[str, Any], step_s: float) -> Table:
    """The pieces as a table, each also as a share of the measured step time ``step_s``."""
    rows = [{"piece": k, "us": v, "share": v / (1e6 * step_s) if step_s > 0 else 0.0}
            for k, v in cost["pieces_us"].items()]
    rows.append({"piece": "total", "us": cost["total_us"],
                 "share": cost["total_us"] / (1e6 * step_s) if step_s > 0 else 0.0})
    return Table("The loop's own cost per optimizer step", [
        Column("piece", "piece"), Column("us", "us per step", lambda v: f"{v:.1f}"),
        Column("share", "of a step", lambda v: f"{100 * v:.2f}%")], rows,
        f"Each piece timed alone (fastest of {cost.get('rounds', 7)} rounds), minus the same torch work done by hand; a step of "
        f"this workload takes {1e3 * step_s:.3f} ms (the raw loop's median). Negative: within timing noise.")
