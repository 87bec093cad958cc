"""``--strategy pipeline`` with real Gloo processes: the same model as one process.

- 2 stages equal 1 process after K Adam steps (1e-5 of the weight scale, as for DDP): SimpleNet;
  an uneven epoch with accumulation, pieces that do not divide evenly and global-norm clipping;
  TinyGPT with its tied embedding and head on different stages; ConvNet (BatchNorm, one piece);
- 3 stages (BiggerNet), so a middle stage that neither loads inputs nor computes the loss;
- the 1F1B schedule (an uneven run, whose one-piece micro-steps fall back to GPipe) and the
  interleaved one (TinyGPT as 4 stages on 2 ranks) equal 1 process too;
- bf16 and fp16 within their tolerance; under fp16 an overflow in one stage makes every stage
  skip the step (one shared check) and keep the same scale;
- only the first stage loads the inputs, only the last the targets;
- checkpoints are whole-model ones: a pipeline checkpoint resumes on one process, and a
  one-process checkpoint resumes as a pipeline, both ending where one process ends; with
  --sharded-checkpoints each stage writes its own part, which resumes as a pipeline and on one
  process alike;
- the CLI prints the stages and the memory per rank, and refuses what cannot work in one line.

The pipeline runs of one world size share one torchrun launch (scripts/pipeline_runs.py); the
one-process references run in this process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from procs import run, scaleloop
from weights import max_rel_diff, weights
from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv
from scaleloop.loop.training import train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
from pipeline_settings import RUNS, SIMPLE  # noqa: E402


def launch(root: Path, which: str, nproc: int, *extra: str) -> dict:
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(SCRIPTS / "pipeline_runs.py"), str(root), which, *extra], cwd=root, timeout=300)
    assert res.returncode == 0, f"pipeline_runs.py {which} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


PIPELINE_ONLY = ("microbatches", "pipeline_schedule", "resume_from_argv", "resume_from_run", "sharded_checkpoints")


def one_process(out: Path, settings: dict, **changes) -> Path:
    settings = {k: v for k, v in settings.items() if k not in PIPELINE_ONLY}
    cfg = TrainConfig(**{**settings, **changes, "out": str(out)}).validate()
    return train(cfg, DistEnv(), log=lambda _msg: None).run_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def single_half(root: Path) -> Path:
    """A one-process run stopped after 3 steps, for the pipeline to resume."""
    return one_process(root / "single-half", SIMPLE, max_steps=3)


@pytest.fixture(scope="module")
def two(root: Path, single_half: Path) -> tuple[Path, dict]:
    return launch_into(root / "two", "two", 2, str(single_half))


def launch_into(out: Path, which: str, nproc: int, *extra: str) -> tuple[Path, dict]:
    out.mkdir(parents=True, exist_ok=True)
    return out, launch(out, which, nproc, *extra)


@pytest.fixture(scope="module")
def three(root: Path) -> tuple[Path, dict]:
    return launch_into(root / "three", "three", 3)


@pytest.mark.parametrize("name", ["simplenet", "uneven", "tinygpt", "convnet", "1f1b-uneven", "interleaved"])
def test_two_stages_equal_one_process(two, root: Path, name: str) -> None:
    out, described = two
    settings = RUNS["two"][name]
    assert described[name]["strategy"].startswith(("pipeline (2 stages", "pipeline (4 stages, 2 per process")), described[name]
    reference = one_process(root / "single" / name, settings)
    diff, key = max_rel_diff(weights(out / name), weights(reference))
    assert diff < 1e-5, f"{name}: pipeline differs from one process by {diff:.2e} of the weight scale at {key}"
    ref_cfg = TrainConfig(**{k: v for k, v in settings.items() if k not in PIPELINE_ONLY}).validate()
    assert described[name]["steps"] == (ref_cfg.optim.max_steps or described[name]["steps"])


def test_uneven_run_trains_every_sample_and_reports_the_same_loss(two, root: Path) -> None:
    out, described = two
    settings = RUNS["two"]["uneven"]
    cfg = TrainConfig(**{k: v for k, v in settings.items() if k != "microbatches"},
                      out=str(root / "single" / "uneven-check")).validate()
    reference = train(cfg, DistEnv(), log=lambda _msg: None)
    got = described["uneven"]
    assert got["steps"] == reference.steps == 10  # 5 steps per epoch (4 of 60, 1 of 10), 2 epochs
    assert got["samples"] == reference.samples == 500
    assert got["train_loss"] == pytest.approx(reference.train_loss, rel=1e-5)
    assert got["test_loss"] == pytest.approx(reference.test.loss, rel=1e-5)


def test_three_stages_equal_one_process(three, root: Path) -> None:
    out, described = three
    assert described["biggernet"]["strategy"].startswith("pipeline (3 stages"), described
    reference = one_process(root / "single" / "biggernet", RUNS["three"]["biggernet"])
    diff, key = max_rel_diff(weights(out / "biggernet"), weights(reference))
    assert diff < 1e-5, f"3 stages differ from one process by {diff:.2e} at {key}"


def test_bf16_equals_one_process(two, root: Path) -> None:
    out, _ = two
    reference = one_process(root / "single" / "bf16", RUNS["two"]["bf16"])
    diff, key = max_rel_diff(weights(out / "bf16"), weights(reference))
    assert diff < 1e-6, f"bf16 pipeline in one piece differs by {diff:.2e} at {key}"
    reference = one_process(root / "single" / "bf16-pieces", RUNS["two"]["bf16-pieces"])
    diff, key = max_rel_diff(weights(out / "bf16-pieces"), weights(reference))
    # bf16 keeps 8 bits of mantissa (relative rounding 4e-3); each piece's gradient is rounded alone
    assert diff < 5e-3, f"bf16 pipeline in 2 pieces differs by {diff:.2e} at {key}"


def test_schedules_are_described(two) -> None:
    _, described = two
    assert described["1f1b-uneven"]["strategy"] == "pipeline (2 stages, 4 micro-batch(es), 1F1B)"
    assert described["interleaved"]["strategy"] == \
        "pipeline (4 stages, 2 per process, 4 micro-batch(es), interleaved 1F1B)"


def test_fp16_equals_one_process_and_every_stage_skips_together(two, root: Path) -> None:
    out, described = two
    reference = one_process(root / "single" / "fp16", RUNS["two"]["fp16"])
    diff, key = max_rel_diff(weights(out / "fp16"), weights(reference))
    # fp16 keeps 11 bits of mantissa; each piece's gradient is rounded alone (as for bf16 above)
    assert diff < 1e-3, f"fp16 pipeline in 2 pieces differs by {diff:.2e} at {key}"
    first, last = described["probe"]["fp16"]
    assert first == last, f"stages disagree on fp16 steps: {first} vs {last}"
    skipped, stepped = first
    assert not skipped["stepped"] and not skipped["changed"] and stepped["stepped"] and stepped["changed"]
    assert stepped["scale"] == skipped["scale"] < 2.0 ** 16   # lowered once, at the skipped step


def test_fp16_with_clipping_clips_the_unscaled_gradients(two, root: Path) -> None:
    out, _ = two
    reference = one_process(root / "single" / "fp16-clip", RUNS["two"]["fp16-clip"])
    unclipped = one_process(root / "single" / "fp16-noclip", {**RUNS["two"]["fp16-clip"], "clip_grad": None})
    active, _ = max_rel_diff(weights(unclipped), weights(reference))
    assert active > 1e-3, "--clip-grad did not clip on one process: the test would not catch a scaled norm"
    diff, key = max_rel_diff(weights(out / "fp16-clip"), weights(reference))
    # One piece: the pipeline runs one process's ops, split at the stage boundary (measured: 0.0;
    # clipping the scaled gradients instead ended 6.6e-2 away).
    assert diff <= 1e-5, f"fp16 + --clip-grad pipeline differs from 1 process by {diff:.2e} at {key}"


def test_only_the_first_stage_loads_inputs_and_only_the_last_targets(two) -> None:
    _, described = two
    assert described["probe"]["loaded"] == [{"inputs": True, "target": False}, {"inputs": False, "target": True}]


def test_pipeline_checkpoint_resumes_on_one_process(two, root: Path) -> None:
    out, _ = two
    run_dir = out / "first-half"
    assert (run_dir / "checkpoints" / "step-00000003").is_dir()
    resumed = one_process(run_dir, SIMPLE, resume=str(run_dir))
    reference = one_process(root / "single" / "six", SIMPLE)
    diff, key = max_rel_diff(weights(resumed), weights(reference))
    assert diff < 1e-5, f"pipeline checkpoint resumed on 1 process differs by {diff:.2e} at {key}"


def test_sharded_pipeline_checkpoints_resume_as_a_pipeline_and_on_one_process(two, root: Path) -> None:
    out, described = two
    half = out / "sharded-half" / "checkpoints" / "step-00000003"
    manifest = json.loads((half / "manifest.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])   # each stage wrote its own part
    reference = weights(one_process(root / "single" / "six-c", SIMPLE))
    assert described["sharded-on"]["steps"] == 6
    diff, key = max_rel_diff(weights(out / "sharded-on"), reference)
    assert diff < 1e-5, f"sharded pipeline checkpoint resumed as a pipeline differs by {diff:.2e} at {key}"
    resumed = one_process(out / "sharded-half", SIMPLE, resume=str(out / "sharded-half"))
    diff, key = max_rel_diff(weights(resumed), reference)
    assert diff < 1e-5, f"sharded pipeline checkpoint resumed on 1 process differs by {diff:.2e} at {key}"


def test_one_process_checkpoint_resumes_as_pipeline(two, root: Path) -> None:
    out, described = two
    assert described["from-single"]["steps"] == 6
    reference = one_process(root / "single" / "six-b", SIMPLE)
    diff, key = max_rel_diff(weights(out / "from-single"), weights(reference))
    assert diff < 1e-5, f"one-process checkpoint resumed as a pipeline differs by {diff:.2e} at {key}"


def test_cli_prints_stages_and_memory(tmp_path: Path) -> None:
    res = scaleloop(["train", "--strategy", "pipeline", "--nproc", "2", "--microbatches", "2", "--model", "biggernet",
                     "--data", "random", "--n-samples", "500", "--epochs", "1", "--no-progress", "--no-tensorboard",
                     "--out", str(tmp_path / "run")], cwd=tmp_path)
    out = res.stdout
    assert "pipeline (2 stages, 2 micro-batch(es), GPipe) x 2" in out
    assert "stage 0: layers" in out and "stage 1: layers" in out
    memory = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert memory["strategy"] == "pipeline" and len(memory["ranks"]) == 2
    shares = [r["parameters"] / r["model_parameters"] for r in memory["ranks"]]
    assert sum(shares) == pytest.approx(1.0) and max(shares) < 0.9, shares


@pytest.mark.parametrize("args, says", [
    (["--nproc", "1"], "add --nproc 2"),
    (["--nproc", "2", "--pipeline-schedule", "1f1b"], "use --microbatches 2 or more, or gpipe"),
    (["--nproc", "2", "--pipeline-schedule", "interleaved"], "cannot be cut into 4 pipeline stages (2 per process)"),
    (["--nproc", "2", "--stages-per-rank", "2"], "needs --pipeline-schedule interleaved"),
    (["--nproc", "3"], "cannot be cut into 3 pipeline stages"),
    (["--nproc", "2", "--batch-size", "8", "--microbatches", "16"], "fewer than --microbatches 16"),
])
def test_cli_refuses_what_cannot_work(tmp_path: Path, args: list[str], says: str) -> None:
    res = run([sys.executable, "-m", "scaleloop", "train", "--strategy", "pipeline", "--epochs", "1",
               "--no-progress", "--out", str(tmp_path / "run"), *args], cwd=tmp_path, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and says in lines[0], res.stderr
    assert "Traceback" not in res.stderr
