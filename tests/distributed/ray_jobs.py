"""The Ray Train job of tests/test_ray.py, on a local Ray cluster: ``python tests/distributed/ray_jobs.py WORK``.

One job of two workers (Ray on 2 cores takes long to start a job, so the job covers every form),
its train function running, one after another:

- ``scaleloop.cli.main(["train", ...])`` (the CLI form), under ddp and under fsdp;
- ``scaleloop train`` as a child process of each worker, under ddp;
- ``scaleloop.ray.train`` (the library form) under fsdp, then under ddp, which stops in step 5
  in the first attempt. Ray restarts the job; the restarted train function removes that run's
  directory (as on a new machine) and the library run continues from Ray's checkpoint of step 3.

``WORK/job.json`` gets what the job's result says and how long it took. The cluster is shut
down at the end, whatever happened.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# One small run, the same in every form and in the torchrun runs it is compared with: 8 steps,
# checkpoints after steps 3, 6 and 8.
SETTINGS = dict(data="random", n_samples=512, hidden_dim=16, batch_size=64, epochs=1, checkpoint_every=3,
                device="cpu", tracker="none", seed=3)
STOP_AT_BATCH = 5   # the ddp library run's first attempt stops in step 5: after the checkpoint of step 3


def flags(strategy: str) -> list[str]:
    """``SETTINGS`` as ``scaleloop train`` flags."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in {**SETTINGS, "strategy": strategy}.items()]


def job(config: dict[str, Any]) -> None:
    """The train function (what it runs: the module's doc)."""
    import ray.train

    import scaleloop.cli
    import scaleloop.ray
    from scaleloop.config import TrainConfig

    work = Path(config["work"])
    first_attempt = ray.train.get_checkpoint() is None
    library = work / "lib-ddp"
    if first_attempt:
        for strategy in ("ddp", "fsdp"):
            assert scaleloop.cli.main(["train", *flags(strategy), "--out", str(work / f"cli-{strategy}")]) == 0
        subprocess.run([sys.executable, "-m", "scaleloop", "train", *flags("ddp"), "--out", str(work / "child-ddp")],
                       check=True, timeout=300)
        result = scaleloop.ray.train(TrainConfig(**SETTINGS, strategy="fsdp", out=str(work / "lib-fsdp")))
        if result.run_dir is not None:
            (result.run_dir / "resumed_from.txt").write_text(str(result.resumed_from))
    elif ray.train.get_context().get_world_rank() == 0:
        (work / "first-attempt.txt").write_text(str(sorted(p.name for p in (library / "checkpoints").iterdir())))
        shutil.rmtree(library)
    batches = []

    def stop_once(_batch: Any) -> None:
        batches.append(1)
        if first_attempt and len(batches) == STOP_AT_BATCH:
            raise RuntimeError("stopped on purpose: Ray restarts the job")

    result = scaleloop.ray.train(TrainConfig(**SETTINGS, strategy="ddp", out=str(library)), on_batch=stop_once)
    if result.run_dir is not None:
        (result.run_dir / "resumed_from.txt").write_text(str(result.resumed_from))


def main(work: Path) -> None:
    # Ray Train is imported here, not with this module: test_ray.py imports SETTINGS and flags from
    # it, and every pytest worker collects that file (one runs it).
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = time.perf_counter()
    # No workers started ahead of need (Ray's prestart): on 2 cores they were idle interpreters that
    # each imported Ray, about 5 CPU-seconds of the file's 63; every actor gets its worker when made.
    ray.init(num_cpus=2, include_dashboard=False,
             _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False})
    try:
        ready = time.perf_counter()
        trainer = TorchTrainer(job, train_loop_config=dict(work=str(work)), scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(name="job", storage_path=str(work / "ray-storage"),
                                                    failure_config=FailureConfig(max_failures=1)))
        result = trainer.fit()
        (work / "job.json").write_text(json.dumps(dict(
            cluster_start_s=ready - started, job_s=time.perf_counter() - ready, metrics=result.metrics,
            checkpoint=result.checkpoint.path if result.checkpoint else None,
            error=repr(result.error) if result.error else None), indent=1))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
