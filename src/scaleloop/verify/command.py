"""``scaleloop verify`` from start to verdict: reference run, distributed run, checks, report.

1. The one-process reference trains K steps here, in this process, recording every step.
2. N workers train the same K steps under torchrun (``nn.DataParallel`` runs here instead);
   their rank 0 records the same things, plus what every rank saw, and saves the run's state
   at every step boundary.
3. One process takes each of those K steps again, here, from the run's state before it
   (``lockstep``): the comparison that decides the verdict.
4. The records are compared (``compare``: lock-step, and the free-running trajectory beside
   it), the data audited (``data``), the replicas' hashes checked (``sync``), a step explained
   (``explain``); on failure, the cause is named (``probes`` + ``diagnose``).

Everything recorded lies in a report directory: a temporary one, or ``--report DIR`` to keep it.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import IterableDataset

from scaleloop.config import TrainConfig, to_toml
from scaleloop.data.batch import first_sample, keeps_target, target_key
from scaleloop.data.info import Datasets
from scaleloop.data.sampler import StepSampler
from scaleloop.runtime.devices import resolve_device
from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.strategies.factory import build_strategy
from scaleloop.strategies.registry import ParallelSettings
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.verify import data as data_check
from scaleloop.verify.compare import (StateDiff, StepDiff, Tolerance, compare_runs, gradient_ratio, tolerance_for,
                                      with_state)
from scaleloop.verify.diagnose import (Cause, buffer_cause, fallback, failure_cause, initial_cause, name_causes,
                                       piece_groups, rank_code_cause, scale_cause)
from scaleloop.verify.explain import format_explain
from scaleloop.launching.failures import Failure
from scaleloop.launching.supervisor import LaunchOutcome
from scaleloop.verify.dirs import (CONFIG_FILE, OPTIONS_FILE, distributed_dir, lockstep_dir, reference_dir,
                                   states_dir)
from scaleloop.verify.launch import failure_report, start_workers, worker_errors
from scaleloop.verify.lockstep import StateLoader, StateSaver, saved_steps
from scaleloop.loop.losses import counting_for, resolve_loss
from scaleloop.verify.options import VerifyOptions
from scaleloop.verify.probes import Probes, run_probes, sample_draws, unsynced_batchnorm
from scaleloop.verify.recorder import RECORD_FILE, Recorder, step_file
from scaleloop.verify.report import (buffer_line, equivalence_verdict, format_table, rounding_note, state_line,
                                     trajectory_line)
from scaleloop.verify.saved import SavedState
from scaleloop.loop.build import build_data_and_model
from scaleloop.verify.steps import RunSpec, run_steps
from scaleloop.verify.sync import format_sync

Say = Callable[[str], None]


@dataclass
class Session:
    """What every part of one verify run needs: settings, where files go, the data and model."""

    cfg: TrainConfig
    opts: VerifyOptions
    root: Path
    say: Say
    device: torch.device
    data: Datasets
    model: nn.Module            # freshly initialised, as both runs start
    world: int                  # ranks of the distributed run (GPUs for dp)
    ref_accumulate: int         # micro-steps of the one-process reference


@dataclass
class Lockstep:
    """What one process recorded taking each step from the distributed run's state before it."""

    losses: list[float]
    states: dict[int, StateDiff]        # the optimizer state after each step, against the run's


@dataclass
class Records:
    """What the two runs recorded, and what the data they trained on says."""

    reference: Optional[dict[str, Any]]
    run: Optional[dict[str, Any]]
    failures: list[dict[str, Any]]
    failure: Optional[Failure]          # the workers' failure report (None: they succeeded, or dp)
    step_problems: list[str]
    content_problems: list[str]
    lockstep: Optional[Lockstep] = None


def verify(cfg: TrainConfig, opts: VerifyOptions, say: Say = print) -> int:
    """Run the checks ``opts`` asks for on the run ``cfg`` describes; 0 if all pass, 1 if any fails."""
    with _report_root(opts.report) as root:
        (root / CONFIG_FILE).write_text(to_toml(cfg), encoding="utf-8")
        opts.write(root / OPTIONS_FILE)
        device = resolve_device(cfg.launch.device, cfg.launch.nproc)  # as its workers choose (auto: CPU if GPUs are too few)
        if cfg.parallel.strategy == "dp":
            build_strategy(ParallelSettings(strategy="dp"), DistEnv(device=device))  # says what to do instead when there are no GPUs
        data, model = build_data_and_model(cfg)
        if isinstance(data.train, IterableDataset):
            raise UsageError(f"--data {cfg.model_data.data!r} is a stream (an IterableDataset): scaleloop verify replays "
                             "each rank's samples by index, so it needs a map-style dataset; train the stream "
                             "with scaleloop train (docs/streaming.md)")
        # BatchNorm sees micro-batches, so the reference must accumulate as the distributed run
        # does (micro-step k covers the same samples for any number of ranks); otherwise one
        # process takes the whole global batch at once, the plainest meaning of "the same training".
        # A pipeline cuts each micro-step further into --microbatches pieces, which BatchNorm sees.
        pieces = cfg.parallel.accumulate * (cfg.parallel.microbatches if _pipeline(cfg) else 1)
        ref_accumulate = pieces if unsynced_batchnorm(model) or cfg.parallel.sync_batchnorm else 1
        session = Session(cfg, opts, root, say, device, data, model, _world(cfg), ref_accumulate)
        _header(session)
        reference, code = _run_both(session)
        lockstep = _run_lockstep(session) if opts.lockstep and reference is not None else None
        return _report(session, reference, code, lockstep)


@contextlib.contextmanager
def _report_root(report: Optional[str]) -> Iterator[Path]:
    if report is None:
        tmp = Path(tempfile.mkdtemp(prefix="scaleloop-verify-"))
        try:
            yield tmp
        finally:
            # On every ending (PASS, FAIL, an error, Ctrl-C): the workers are stopped by then, and
            # what a failure's logs say is printed; --report DIR keeps them.
            shutil.rmtree(tmp, ignore_errors=True)
        return
    root = Path(report)
    if root.exists() and any(root.iterdir()) and not (root / OPTIONS_FILE).exists():
        raise UsageError(f"--report {report}: the directory exists and is not a verify report; "
                         "give a new or empty directory")
    for old in (reference_dir(root), distributed_dir(root)):
        shutil.rmtree(old, ignore_errors=True)  # a previous report's records, never the user's files
    root.mkdir(parents=True, exist_ok=True)
    yield root


def _pipeline(cfg: TrainConfig) -> bool:
    """Whether the distributed run cuts the model into stages (``--strategy pipeline``, or
    ``--mesh pp=S,dp=R``: S stages, each replicated R times)."""
    return cfg.pipeline_layout() is not None


def _replicas(cfg: TrainConfig) -> int:
    """A pipeline's replicas (1 without --mesh pp=S,dp=R)."""
    layout = cfg.pipeline_layout()
    return layout[1] if layout is not None else 1


def _world(cfg: TrainConfig) -> int:
    if cfg.parallel.strategy == "dp":
        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return cfg.world_size


def _load(path: Path) -> Optional[dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _header(s: Session) -> None:
    cfg = s.cfg
    s.say(f"verify: {cfg.model_data.model} on {s.data.info.name} ({len(s.data.train):,} training samples), global batch "
          f"{cfg.optim.batch_size}, {s.opts.steps} step(s), {cfg.parallel.precision}, {cfg.optim.optimizer} lr {cfg.optim.lr:g}, seed {cfg.optim.seed}"
          + (f", loss {s.cfg.model_data.loss}" if s.cfg.model_data.loss else ""))
    if s.opts.needs_reference:
        s.say(f"  reference:   1 process (single), accumulate {s.ref_accumulate}: "
              f"{cfg.optim.batch_size // s.ref_accumulate} samples per backward")
    if _pipeline(cfg):
        r = _replicas(cfg)
        copies = f" in {r} replicas" if r > 1 else ""
        share = "all" if r == 1 else "its replica's"
        s.say(f"  distributed: {s.world} processes (pipeline), one stage of the model each{copies}, accumulate "
              f"{cfg.parallel.accumulate}: every stage runs {share} {cfg.optim.batch_size // (r * cfg.parallel.accumulate)} samples per "
              f"backward in {cfg.parallel.microbatches} pipeline micro-batch(es)")
        return
    # --mesh: the batch is split over its dp x fsdp ranks only (a tp group shares its samples).
    data_ranks = MeshSpec.parse(cfg.parallel.mesh).data_parallel if cfg.parallel.mesh else s.world
    s.say(f"  distributed: {s.world} {'GPUs in 1 process' if cfg.parallel.strategy == 'dp' else 'processes'} ({cfg.parallel.strategy}), "
          f"accumulate {cfg.parallel.accumulate}: {cfg.optim.batch_size // (data_ranks * cfg.parallel.accumulate)} samples per rank per "
          "backward" + (", --sync-batchnorm" if cfg.parallel.sync_batchnorm else ""))


# --- the two runs ------------------------------------------------------------------------
def _run_both(s: Session) -> tuple[Optional[dict[str, Any]], int]:
    """The reference record (None if not needed) and the distributed run's exit code.

    On the CPU the workers start first and the reference trains while they import torch (it
    saves seconds); on an accelerator one after the other, so that the reference and rank 0
    never hold the model on one device at the same time.
    """
    def reference() -> Optional[dict[str, Any]]:
        return _run_reference(s) if s.opts.needs_reference else None

    if s.cfg.parallel.strategy == "dp":
        return reference(), _run_dataparallel(s)
    indent: Say = lambda line: s.say(f"  {line}")
    if s.device.type != "cpu":
        ref = reference()
        if s.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the reference's cached memory back before rank 0 needs it
        with start_workers(s.cfg, s.root, indent) as workers:
            return ref, _ended(workers.wait())
    with start_workers(s.cfg, s.root, indent) as workers:
        ref = reference()
        return ref, _ended(workers.wait())


def _ended(outcome: LaunchOutcome) -> int:
    """The workers' exit code; KeyboardInterrupt when they ended on SIGINT that did not reach this
    process (``kill -INT`` on torchrun, a shell that started verify with SIGINT ignored): an
    interrupted comparison has no verdict, as for a Ctrl-C heard here."""
    if outcome.code != 0 and outcome.interrupted():
        raise KeyboardInterrupt
    return outcome.code


def _run_reference(s: Session) -> dict[str, Any]:
    env = DistEnv(device=s.device)
    recorder = Recorder(env, reference_dir(s.root), explain_step=s.opts.explain_step)
    try:
        run_steps(s.cfg, env, RunSpec("single", s.ref_accumulate, s.opts.steps), recorder)
    except UsageError:
        raise
    except Exception as exc:  # the user's model or loss fails on its own: nothing to compare
        raise UsageError(f"the one-process reference run failed at step {recorder.step}: "
                         f"{type(exc).__name__}: {exc}") from None
    record = _load(reference_dir(s.root) / RECORD_FILE)
    assert record is not None
    return record


def _run_dataparallel(s: Session) -> int:
    """The distributed side for ``dp``: nn.DataParallel over every GPU, in this process."""
    env = DistEnv(device=s.device)
    recorder = Recorder(env, distributed_dir(s.root), explain_step=s.opts.explain_step,
                        audit_data="data" in s.opts.checks, check_sync=s.opts.hashes_replicas)
    saver = StateSaver(states_dir(s.root), env) if s.opts.lockstep else None
    try:
        run_steps(s.cfg, env, RunSpec("dp", s.cfg.parallel.accumulate, s.opts.steps), recorder, boundary=saver)
    except UsageError:
        raise
    except Exception as exc:
        recorder.fail(exc)
        return 1
    return 0


def _run_lockstep(s: Session) -> Optional[Lockstep]:
    """One process takes each step the distributed run recorded again, from the state the run saved
    before it (``lockstep``); None when the run recorded no step, or when the one-process run cannot
    load that state (said: the verdict then falls back to the free-running trajectory)."""
    run_dir = distributed_dir(s.root)
    recorded = 0
    while recorded < s.opts.steps and step_file(run_dir, recorded + 1).exists():
        recorded += 1
    steps = min(recorded, saved_steps(states_dir(s.root)))
    if steps == 0:
        return None
    env = DistEnv(device=s.device)
    recorder = Recorder(env, lockstep_dir(s.root))
    state_loader = StateLoader(states_dir(s.root))
    try:
        run_steps(s.cfg, env, RunSpec("single", s.ref_accumulate, steps), recorder, boundary=state_loader)
    except Exception as exc:  # noqa: BLE001 - the user's model that cannot take a saved state back: said
        s.say(f"  lock-step comparison not possible ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); "
              "the verdict falls back to the free-running comparison")
        return None
    record = _load(lockstep_dir(s.root) / RECORD_FILE)
    assert record is not None
    return Lockstep(record["losses"], state_loader.diffs)


# --- the report --------------------------------------------------------------------------
def _report(s: Session, reference: Optional[dict[str, Any]], code: int, lockstep: Optional[Lockstep] = None) -> int:
    run_dir = distributed_dir(s.root)
    run = _load(run_dir / RECORD_FILE)
    failures = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(run_dir.glob("failure-rank*.json"))]
    failure = failure_report(s.root, s.cfg, code) if code != 0 and s.cfg.parallel.strategy != "dp" else None
    if run is None and not failures:
        s.say(f"verdict: FAIL - the worker processes failed (exit code {code}) before recording anything"
              + (_kept(s) if failure is not None else ":"))
        lines = (_failure_lines(Records(None, None, [], failure, [], []), bool(s.opts.report))
                 if failure is not None else [f"  {e}" for e in worker_errors(s.root)])
        for line in lines:
            s.say(line)
        return 1
    ranks = run["ranks"] if run else []
    ref_micro = reference["ranks"][0]["micro"] if reference else []
    data_ranks, stage_problems = _data_ranks(s, ranks)
    records = Records(reference, run, failures, failure,
                      stage_problems + (data_check.step_mismatches(ref_micro, data_ranks, s.opts.steps)
                                        if reference else []),
                      data_check.content_mismatches(s.data.train, ranks), lockstep)

    results: list[tuple[str, bool]] = []
    if "equivalence" in s.opts.checks and reference is not None:
        results.append(("equivalence", _equivalence(s, records)))
    elif failures or failure is not None:
        s.say("verdict: FAIL")
        for line in _failure_lines(records, bool(s.opts.report)):
            s.say(line)
        results.append(("run", False))
    if run is not None and "data" in s.opts.checks:
        results.append(("data", _data(s, records)))
    if run is not None and "sync" in s.opts.checks and run.get("sync") is not None:
        passed, lines = format_sync(run["sync"], run["steps_done"])
        for line in lines:
            s.say(line)
        results.append(("sync", passed))
    if run is not None and s.opts.explain_step is not None:
        if _pipeline(s.cfg):
            s.say("explain: not available under --strategy pipeline: every rank runs its own stage of the model on "
                  "the same samples, so there is no per-rank gradient of one parameter to all-reduce; the step "
                  "table compares every parameter and gradient with 1 process")
        else:
            for line in format_explain(s.opts.explain_step, run, reference):
                s.say(line)
    if run is not None and not failures and failure is not None:
        results.append(("shutdown", _shutdown(s, records, code, dict(results).get("equivalence", True))))
    failed = [name for name, ok in results if not ok]
    summary = "; ".join(f"{name} {'passed' if ok else 'FAILED'}" for name, ok in results)
    s.say(f"verify: {'FAIL' if failed else 'PASS'} ({summary})" + _kept(s))
    return 1 if failed else 0


def _shutdown(s: Session, r: Records, code: int, reported: bool) -> bool:
    """Every step was recorded, yet a worker exited with an error (at shutdown, or after its last
    collective): said, with the failure report, and failed: ``scaleloop train`` would end the same way."""
    s.say(f"shutdown: FAIL - every step was recorded, but the workers exited with code {code} afterwards "
          "(a rank aborted at shutdown: at exit, in destroy_process_group, or in its own atexit code)")
    if reported:   # a failed equivalence has printed the report already
        for line in _failure_lines(r, bool(s.opts.report)):
            s.say(line)
    return False


def _kept(s: Session) -> str:
    return f"; records kept in {s.root}" if s.opts.report else ""


def _failure_lines(r: Records, kept: bool) -> list[str]:
    """Why the distributed run stopped: the short report (the rank that failed first or stalled,
    the user's line, the logs); the ranks' own records where there is none (dp, in this process).

    Without ``kept`` (no --report) the logs go with the temporary directory: not pointed to.
    """
    if r.failure is not None:
        if kept:
            return r.failure.report
        return ([line for line in r.failure.report if not line.startswith("  logs: ")]
                + ["  (the workers' logs are removed with verify's temporary directory: run again with "
                   "--report DIR to keep them)"])
    return failure_cause(r.failures).lines() if r.failures else []


def _equivalence(s: Session, r: Records) -> bool:
    """The step tables (lock-step, which decides, then the free-running trajectory), the models as
    built and the ranks' final copies, the verdict; on failure, the causes."""
    assert r.reference is not None
    free = tolerance_for(s.cfg.parallel.precision, s.opts.tolerance, s.cfg.optim.optimizer, s.cfg.optim.lr)
    run_losses = r.run["losses"] if r.run else (min(r.failures, key=lambda f: f["rank"]).get("losses") or [])
    trajectory = compare_runs(reference_dir(s.root), distributed_dir(s.root), r.reference["losses"], run_losses,
                              s.opts.steps, free)
    rows, tol = trajectory, free
    if r.lockstep is not None:
        tol = free.per_step()
        rows = with_state(compare_runs(lockstep_dir(s.root), distributed_dir(s.root), r.lockstep.losses, run_losses,
                                       s.opts.steps, tol), r.lockstep.states)
        s.say(f"  lock-step (decides the verdict): before each step, 1 process loads the state the {s.world} "
              "processes had (weights, buffers, optimizer state) and takes the same step on the same samples")
    saved = SavedState.load(reference_dir(s.root), distributed_dir(s.root), r.run)
    for line in format_table(rows, s.world, tol):
        s.say(line)
    for line in (f"  {tol.describe()}", buffer_line(rows), state_line(rows),
                 rounding_note(rows, tol, s.cfg.optim.optimizer)):
        if line:
            s.say(line)
    passed, verdict = equivalence_verdict(rows, s.opts.steps, s.world, s.cfg.parallel.strategy, tol, bool(r.failures),
                                          saved.problems(tol), trajectory=trajectory if r.lockstep else None)
    if r.lockstep is not None:
        s.say("  trajectory (shown, not judged): both runs free from the same start, each carrying its own "
              "rounding into its next step")
        for line in format_table(trajectory, s.world, free, mark="  (beyond the free-running tolerance)"):
            s.say(line)
        s.say(trajectory_line(trajectory, free, lockstep_passed=not any(row.failures(tol) for row in rows)))
    s.say(verdict)
    _draw(s, rows, tol)
    note = saved.note(not passed)
    if note:
        s.say(note)
    if _pipeline(s.cfg):
        # Said, not skipped silently: what this comparison does not cover under the pipeline.
        s.say("  (pipeline: the loss is the last stage's; parameters and gradients are gathered from all stages "
              "under the model's own names; each rank finds the unused parameters of its own stage; --explain "
              "does not apply: no rank computes a gradient another rank also computes)")
    if passed:
        return True
    for line in _failure_lines(r, bool(s.opts.report)):
        s.say(line)
    causes = _causes(s, r, rows, saved, tol)
    if causes:
        s.say("diagnosis:")
        for cause in causes:
            for line in cause.lines():
                s.say(line)
    return False


def _draw(s: Session, rows: list[StepDiff], tol: Tolerance) -> None:
    """The picture (``--plot FILE``; ``verify.png`` in a kept report), said in one line."""
    targets = [Path(p) for p in (s.opts.plot, s.opts.report and str(Path(s.opts.report) / "verify.png")) if p]
    if not targets or not rows:
        return
    from scaleloop.verify.plot import plot_verify

    try:
        for target in targets:
            plot_verify(rows, tol, s.world, s.cfg.parallel.strategy, target)
    except ImportError:
        s.say("  (no picture: --plot needs matplotlib)")
        return
    except OSError as exc:
        s.say(f"  (no picture: cannot write {str(exc.filename or targets[0])!r}: {exc.strerror})")
        return
    s.say(f"  picture: {', '.join(str(t) for t in targets)}")


def _causes(s: Session, r: Records, rows: list[StepDiff], saved: SavedState, tol: Tolerance) -> list[Cause]:
    """Every named cause of a failed equivalence, most certain first; the fallback when none is known."""
    assert r.reference is not None
    no_grad = sorted({n for rank in (r.run["ranks"] if r.run else []) for names in rank["no_grad"].values()
                      for n in names}
                     | {n for f in r.failures for names in f.get("no_grad_before", {}).values() for n in names})
    step_samples = len(data_check.step_indices(r.reference["ranks"][0]["micro"], 1))
    world, accumulate = _pieces(s)
    probes = _probe(s, r.reference)
    initial = initial_cause(saved.initial.worst() if saved.initial_differs(tol) and saved.initial else None,
                            saved.initial_per_rank)
    named = [initial] if initial is not None else []
    named += name_causes(s.cfg, world=world, accumulate=accumulate, step_samples=step_samples,
                         probes=probes, step_problems=r.step_problems,
                         content_problems=r.content_problems, no_grad=no_grad,
                         data_draws=_sample_draws(s) if r.content_problems else None)
    rank_code = rank_code_cause(list((r.run or {}).get("output_diverging") or []), probes)
    named += [rank_code] if rank_code is not None else []
    if initial is None:   # from other weights, step 1's gradients say nothing about a scale
        ratio = gradient_ratio(reference_dir(s.root), distributed_dir(s.root), tol)
        scaled = scale_cause(ratio, world=world, accumulate=accumulate, probes=probes)
        named += [scaled] if scaled is not None else []
    buffers = _stray_buffers(s, rows, saved, tol)
    if buffers is not None:
        named.append(buffers)
    if not named and not (r.failures or r.failure):   # a failed run's report above says why
        bad = next((row for row in rows if row.failures(tol)), None)
        named.append(fallback(s.cfg, f"step {bad.step}, {bad.worst_param}" if bad else None))
    return named


def _sample_draws(s: Session) -> Optional[str]:
    """Whether reading a training sample draws random numbers (None too where it cannot be read by index)."""
    if isinstance(s.data.train, IterableDataset) or len(s.data.train) == 0:
        return None
    try:
        return sample_draws(s.data.train, 0)
    except Exception:  # noqa: BLE001 (a probe: a dataset it cannot read is left unprobed)
        return None


def _stray_buffers(s: Session, rows: list[StepDiff], saved: SavedState, tol: Tolerance) -> Optional[Cause]:
    """Buffers that ended apart between ranks, or that alone differ from one process's, other than
    the statistics of BatchNorm layers that are not synchronised (named by their own rule)."""
    batchnorm = [] if s.cfg.parallel.sync_batchnorm else [f"{b.split(' (')[0]}." for b in unsynced_batchnorm(s.model)]
    own = lambda name: not any(name.startswith(prefix) for prefix in batchnorm)   # noqa: E731
    between = [n for n in saved.replica_buffers() if own(n)]
    if between:
        return buffer_cause(between, between_ranks=True)
    only_buffers = [row for row in rows if row.failures(tol) and tol.params_equal(row.step, row.param_abs, row.param_rel)
                    and row.grad_rel <= tol.grads_at(row.step) and row.loss_rel <= tol.loss]
    names = [n for row in only_buffers[:1] for n in (row.worst_buffer, *row.unequal_buffers) if n and own(n)]
    return buffer_cause(list(dict.fromkeys(names)), between_ranks=False)


def _pieces(s: Session) -> tuple[int, int]:
    """(data-parallel ranks, pieces per rank and step) of the distributed run: how its step's batch is cut.

    A pipeline's stages all see their replica's share of the batch (all of it without
    replicas), cut into --accumulate micro-steps of --microbatches pieces each.
    """
    if _pipeline(s.cfg):
        return _replicas(s.cfg), s.cfg.parallel.accumulate * s.cfg.parallel.microbatches
    return s.world, s.cfg.parallel.accumulate


def _data_ranks(s: Session, ranks: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The ranks whose samples make up the distributed run's steps, and problems found in doing so.

    Data-parallel ranks each train on their share: all of them. A pipeline's stages all walk the
    same batches (the first stage uses the inputs, the last the targets): stage 0 (its copy in
    each replica) stands for the run, and every other stage must have loaded exactly its samples.
    """
    if not _pipeline(s.cfg) or not ranks:
        return ranks, []
    r = _replicas(s.cfg)   # rank p*r + d is stage p of replica d

    def walked(rank: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(m["step"], m["micro"], m["indices"]) for m in rank["micro"]]

    problems = [f"stage {rank['rank'] // r} (rank {rank['rank']}) loaded other batches than stage 0 of its replica "
                "(the stages of a pipeline must walk the same samples)" for rank in ranks[r:]
                if walked(rank) != walked(ranks[rank["rank"] % r])]
    return ranks[:r], problems


def _probe(s: Session, reference: dict[str, Any]) -> Optional[Probes]:
    """Run the probes on the first step's batch; None when that batch cannot be rebuilt."""
    indices = data_check.step_indices(reference["ranks"][0]["micro"], 1)
    if not indices:
        return None
    x, y = data_check.load_samples(s.data.train, indices)
    world, accumulate = _pieces(s)
    groups = piece_groups(len(indices), world, accumulate, s.ref_accumulate)
    model = s.model.to(s.device)
    keep = keeps_target(model, s.data.train, s.data.info.task)
    counting, _ = counting_for(s.data.info, s.data.train, model, s.cfg.model_data.loss, keep)
    if isinstance(x, dict) and isinstance(y, torch.Tensor) and keep is True and s.cfg.model_data.loss is None:
        # Keyword inputs to a model computing its own loss from the labels: only that loss is probed.
        key = target_key(first_sample(s.data.train))
        return run_probes(model, resolve_loss(None, s.data.info, given_target=True),
                          {k: v.to(s.device) if isinstance(v, torch.Tensor) else v for k, v in x.items()},
                          y.to(s.device), groups, counted=counting is not None, own_target=key)
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None  # the probes cut tensors into pieces; named or several inputs are not probed
    x, y = x.to(s.device), y.to(s.device)
    return run_probes(model, resolve_loss(s.cfg.model_data.loss, s.data.info), x, y, groups, counted=counting is not None)


def _data(s: Session, r: Records) -> bool:
    """``--check data``: the per-rank batch digests, the steps against the reference, the coverage."""
    assert r.run is not None
    ranks, n = r.run["ranks"], r.run["n_samples"]
    data_ranks, _ = _data_ranks(s, ranks)
    data_world = _pieces(s)[0]
    s.say("data: SHA-256 of every batch each rank trained on, checked against the dataset's samples at its indices")
    for line in data_check.batch_table(ranks, s.data.train, r.run["accumulate"]):
        s.say(line)
    mismatches = r.content_problems + data_check.content_mismatches(s.data.train, ranks, key="audit")
    batches = sum(len(rank["micro"]) + len(rank["audit"]) for rank in ranks)
    s.say("  content: " + (f"every one of {batches} batches matches" if not mismatches else f"MISMATCH: {mismatches[0]}"))
    if r.reference is not None:
        s.say("  steps: " + ("each step's samples over all ranks are exactly those 1 process trains on"
                             if not r.step_problems else f"MISMATCH: {r.step_problems[0]}"))
    passed = not mismatches and not r.step_problems
    dropped = StepSampler(n, s.cfg.optim.batch_size, world_size=data_world, accumulate=s.cfg.parallel.accumulate,
                          drop_last=s.cfg.optim.drop_last).dropped_per_epoch
    s.say("coverage: which samples each epoch used, over all ranks"
          + (" (pipeline: stage 0's, which every stage walks)" if _pipeline(s.cfg) else ""))
    for epoch in sorted({m["epoch"] for rank in data_ranks for m in rank["audit"]}):
        cov = data_check.coverage((m["indices"] for rank in data_ranks for m in rank["audit"]
                                   if m["epoch"] == epoch), n, epoch)
        ok, line = data_check.format_coverage(cov, data_world, dropped)
        passed &= ok
        s.say(line)
    if data_world > 1:
        s.say(data_check.format_sampler_comparison(n, s.world, s.cfg.optim.seed))
    s.say(f"data verdict: {'PASS' if passed else 'FAIL'}")
    return passed
