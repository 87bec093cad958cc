"""The program each worker process runs when ``scaleloop verify`` starts them under torchrun.

Not for users: ``python -m scaleloop.verify.worker REPORT_DIR`` reads the resolved settings the
verify command wrote into ``REPORT_DIR``, trains the K steps on this rank and records them
(rank 0 writes), saving the run's state at every step boundary for the lock-step comparison. A failure is written to ``failure-rank<R>.json`` for the parent's comparison
(the steps done, the losses) and raised again, with the step it happened in: the verify
command starts this program through ``scaleloop.launching.worker``, whose ``record`` puts it in
torchrun's error file for the short failure report; the worker exits with 1, and torchrun stops
the other ranks at once.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from scaleloop.config import load_toml, resolve
from scaleloop.runtime.dist import DistEnv, end_process_group, init_process_group
from scaleloop.runtime.frames import note_where
from scaleloop.verify.dirs import CONFIG_FILE, OPTIONS_FILE, distributed_dir, states_dir
from scaleloop.verify.lockstep import StateSaver
from scaleloop.verify.options import VerifyOptions
from scaleloop.verify.recorder import Recorder
from scaleloop.verify.steps import RunSpec, run_steps

def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m scaleloop.verify.worker REPORT_DIR (started by scaleloop verify)", file=sys.stderr)
        return 2
    root = Path(args[0])
    cfg = resolve(load_toml(root / CONFIG_FILE), {})
    opts = VerifyOptions.read(root / OPTIONS_FILE)
    # --timeout: a rank that stops taking part makes the others stop after that long.
    env = DistEnv.from_env(device=cfg.launch.device, backend=cfg.launch.backend, timeout_s=cfg.launch.timeout)
    init_process_group(env)
    recorder = Recorder(env, distributed_dir(root), explain_step=opts.explain_step,
                        audit_data="data" in opts.checks, check_sync=opts.hashes_replicas)
    failed = True
    try:
        # For the lock-step comparison the run's state is saved at every step boundary.
        saver = StateSaver(states_dir(root), env) if opts.lockstep else None
        run_steps(cfg, env, RunSpec(cfg.parallel.strategy, cfg.parallel.accumulate, opts.steps), recorder, boundary=saver)
        failed = False
    except Exception as exc:  # recorded for the parent's comparison, then to torchrun's error file
        recorder.fail(exc)
        note_where(exc, None, recorder.step)
        raise
    finally:
        end_process_group(failed=failed)   # after a failure, once its error is recorded
    return 0


if __name__ == "__main__":
    sys.exit(main())
