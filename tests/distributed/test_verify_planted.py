"""``scaleloop verify`` names bugs planted in a user's model and loss, on real 2-process Gloo groups.

The models and the loss are in ``scripts/verify_planted.py``, copied into each test's directory
(the verify process imports ``--model planted:NAME`` from there; its workers too). Each test is
one verify run started through ``procs.run``, so that no process outlives it; ``TMPDIR`` points
into the test's directory, where verify's temporary directory must be gone at the end.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from procs import child_env, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PLANTED = Path(__file__).resolve().parent / "scripts" / "verify_planted.py"
COMMON = ["--data", "images", "--image-size", "8", "--batch-size", "32", "--steps", "2", "--device", "cpu",
          "--n-samples", "128"]


def verify(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    shutil.copy(PLANTED, cwd / "planted.py")
    (cwd / "tmp").mkdir(exist_ok=True)
    return run([sys.executable, "-m", "scaleloop.verify", *COMMON, *args], cwd=cwd, timeout=240,
               env=child_env({"TMPDIR": str(cwd / "tmp")}))


def explain(res: subprocess.CompletedProcess) -> str:
    return f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"


def no_temporary_directory_left(cwd: Path) -> bool:
    return not list((cwd / "tmp").glob("scaleloop-verify-*"))


def test_a_buffer_updated_per_rank_fails_and_is_named(tmp_path: Path) -> None:
    # An EMA of the features that only evaluation uses: the parameters agree, the saved model does not.
    res = verify(["--model", "planted:FeatureEma", "--optimizer", "sgd"], tmp_path)
    assert res.returncode == 1, explain(res)
    out = res.stdout
    assert "verdict: FAIL - from step 1: buffers" in out and "worst ema" in out, out
    assert "rank 1's saved state differs from rank 0's after 2 step(s): ema (buffer)" in out
    diagnosis = out[out.index("diagnosis:"):]
    assert "a buffer updated per rank without synchronisation: ema" in diagnosis
    assert "no known cause" not in diagnosis
    assert no_temporary_directory_left(tmp_path)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_loss_divided_by_the_world_size_is_named(tmp_path: Path, optimizer: str) -> None:
    res = verify(["--model", "planted:Mlp", "--loss", "planted:loss_over_world", "--optimizer", optimizer], tmp_path)
    assert res.returncode == 1, explain(res)
    diagnosis = res.stdout[res.stdout.index("diagnosis:"):]
    assert "a manual division (or multiplication) of the loss or gradients by the world size" in diagnosis, diagnosis
    assert "exactly 0.5 x one process's" in diagnosis and "no known cause" not in diagnosis


def test_initial_weights_that_differ_per_rank_are_found_at_step_0(tmp_path: Path) -> None:
    res = verify(["--model", "planted:Unseeded", "--optimizer", "sgd"], tmp_path)
    assert res.returncode == 1, explain(res)
    out = res.stdout
    assert "verdict: FAIL - from step 0 (the models as built, before any step): rank 0's initial parameters" in out
    diagnosis = out[out.index("diagnosis:"):]
    assert "initial weights differ per rank: rank 0's model as built differs from the one process's" in diagnosis
    assert "rank 1's differs from rank 0's" in diagnosis and "seed before building it" in diagnosis
    assert "no known cause" not in diagnosis


def test_a_rank_that_aborts_at_shutdown_is_no_silent_pass(tmp_path: Path) -> None:
    res = verify(["--model", "planted:AbortsAtExit"], tmp_path)
    assert res.returncode == 1, explain(res)
    out = res.stdout
    assert "verdict: PASS - 2 processes (ddp)" in out  # what was trained is still the same
    assert "shutdown: FAIL - every step was recorded, but the workers exited with code" in out
    assert "rank 1 of 2 exited with code 3" in out
    assert out.rstrip().splitlines()[-1] == "verify: FAIL (equivalence passed; shutdown FAILED)"
    assert "records kept" not in out and no_temporary_directory_left(tmp_path)


@pytest.mark.parametrize("model, cause", [
    ("PrivateNoise", "randomness from a generator of the model's own: two forward passes from the same global"),
    ("ReseedsPerRank", "the forward pass re-seeds the random generator"),
    ("RankBranch", "rank-dependent code: with the same weights, the same inputs and the same random seed, rank(s) 1"),
])
def test_randomness_and_rank_dependent_code_are_named(tmp_path: Path, model: str, cause: str) -> None:
    res = verify(["--model", f"planted:{model}", "--optimizer", "sgd"], tmp_path)
    assert res.returncode == 1, explain(res)
    diagnosis = res.stdout[res.stdout.index("diagnosis:"):]
    assert cause in diagnosis, diagnosis
    # Not the causes these used to be mistaken for.
    assert "couples the samples" not in diagnosis and "no known cause" not in diagnosis, diagnosis
    assert diagnosis.count("\n  - ") == 1, diagnosis


def test_per_rank_augmentation_is_named_and_the_advice_works(tmp_path: Path) -> None:
    res = verify(["--model", "planted:Mlp", "--data", "planted:augmented", "--optimizer", "sgd"], tmp_path)
    assert res.returncode == 1, explain(res)
    diagnosis = res.stdout[res.stdout.index("diagnosis:"):]
    assert "samples are augmented at random per rank" in diagnosis and "seeded by the sample's index" in diagnosis
    assert "seed any randomness in the dataset factory" not in diagnosis
    fixed = verify(["--model", "planted:Mlp", "--data", "planted:augmented_by_index", "--optimizer", "sgd"], tmp_path)
    assert fixed.returncode == 0, explain(fixed)
def test_a_models_own_token_mean_over_padding_is_named(tmp_path: Path) -> None:
    # Issue 28 point 3: a model's own mean over each micro-batch's real tokens, which it cannot be
    # told the step's count for, used to leave verify with "no known cause found".
    res = verify(["--model", "planted:TokenMeanLM", "--data", "planted:padded_lm", "--optimizer", "sgd",
                  "--lr", "0.5", "--accumulate", "2"], tmp_path)
    assert res.returncode == 1, explain(res)
    out = res.stdout
    assert "verdict: FAIL - from step 1" in out, out
    diagnosis = out[out.index("diagnosis:"):]
    assert ("the model's own loss is a mean over each micro-batch's real tokens, and the micro-batches hold "
            "different counts of -100 padding") in diagnosis, diagnosis
    assert "pieces that 2 ranks x 2 micro-step(s) compute" in diagnosis and "no known cause" not in diagnosis
    assert no_temporary_directory_left(tmp_path)


def test_an_aux_head_used_every_other_step_is_named_without_randomness(tmp_path: Path) -> None:
    # Issue 41.11: its forward draws no random number, but two passes differ (the aux head every
    # other call), which verify read as "randomness from a generator of the model's own".
    res = verify(["--model", "planted:AuxEveryOther", "--optimizer", "sgd"], tmp_path)
    assert res.returncode == 1, explain(res)
    out = res.stdout
    assert "UsageError: parameter(s) aux.weight, aux.bias got no gradient on rank" in out, out
    diagnosis = out[out.index("diagnosis:"):]
    assert diagnosis.count("\n  - ") == 1 and "  - unused parameters: aux.weight, aux.bias got no gradient" in diagnosis
    assert "random" not in diagnosis and "couples the samples" not in diagnosis, diagnosis


def test_a_batch_level_loss_term_is_named_not_a_per_piece_count(tmp_path: Path) -> None:
    # Issue 41.11: a penalty on the batch-mean logit was named "loss normalised per micro-batch ...
    # divides by a count of its own piece"; nothing divides by a count.
    res = verify(["--model", "planted:Mlp", "--loss", "planted:loss_with_mean_logit_penalty", "--optimizer", "sgd"],
                 tmp_path)
    assert res.returncode == 1, explain(res)
    diagnosis = res.stdout[res.stdout.index("diagnosis:"):]
    assert diagnosis.count("\n  - ") == 1, diagnosis
    assert "  - the loss holds a term of the whole batch that is not a mean over its samples: " in diagnosis
    assert "divides by a count" not in diagnosis and "per-sample terms" in diagnosis, diagnosis
    assert no_temporary_directory_left(tmp_path)
