"""Step-by-step comparison: differences, the rounding-level exclusion, tolerances, the verdict."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from scaleloop.verify.compare import (TOLERANCES, StateDiff, StepDiff, compare_runs, optimizer_state_diff,
                                      rounding_level, tensor_diff, tolerance_for, with_state)
from scaleloop.verify.recorder import step_file
from scaleloop.verify.report import equivalence_verdict, format_table, rounding_note, state_line, trajectory_line

FP32 = TOLERANCES["fp32"]


def test_tensor_diff_finds_the_largest_difference_relative_to_the_largest_weight() -> None:
    ref = {"a": torch.tensor([1.0, -4.0]), "b": torch.tensor([0.5])}
    assert tensor_diff(ref, {k: v.clone() for k, v in ref.items()}) == (0.0, 0.0, "")
    run = {"a": torch.tensor([1.0, -4.0]), "b": torch.tensor([0.7])}
    d_abs, d_rel, worst = tensor_diff(ref, run)
    assert worst == "b" and math.isclose(d_abs, 0.2, rel_tol=1e-6) and math.isclose(d_rel, 0.05, rel_tol=1e-6)


def test_a_missing_gradient_counts_as_zeros_and_a_shape_change_as_infinite() -> None:
    assert tensor_diff({"g": torch.tensor([2.0])}, {})[0] == 2.0
    assert tensor_diff({}, {"g": torch.tensor([3.0])})[0] == 3.0
    assert tensor_diff({"w": torch.zeros(2)}, {"w": torch.zeros(3)}) == (math.inf, math.inf, "w")
    assert tensor_diff({"w": torch.tensor([1.0])}, {"w": torch.tensor([float("nan")])})[1] == math.inf


def test_rounding_level_marks_noise_gradients_but_not_exact_zeros() -> None:
    # "bias" is pure noise (its true gradient is zero); "dead" is exactly zero in both runs;
    # "w" is a real gradient with a small rounding difference.
    ref = {"w": torch.tensor([0.5, -0.25]), "bias": torch.tensor([3e-9, -2e-9]), "dead": torch.zeros(2)}
    run = {"w": torch.tensor([0.5 + 1e-8, -0.25]), "bias": torch.tensor([-1e-9, 4e-9]), "dead": torch.zeros(2)}
    masks = rounding_level(ref, run, FP32.grads)
    assert masks["bias"].all() and not masks["w"].any() and not masks["dead"].any()
    # A gradient one run has and the other lacks (None vs a value) is no rounding noise.
    assert not rounding_level({"g": torch.tensor([0.0, 1.0])}, {"g": torch.tensor([0.5, 1.0])}, FP32.grads)["g"][0]


def _write(run_dir: Path, step: int, params: dict, grads: dict) -> None:
    run_dir.mkdir(exist_ok=True)
    torch.save({"params": params, "grads": grads}, step_file(run_dir, step))


def test_compare_runs_leaves_out_what_adam_did_to_noise_but_catches_real_differences(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    grads_ref = {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([3e-9])}
    grads_run = {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([-3e-9])}
    # Step 1: Adam moved the noise-gradient bias by +lr in one run and -lr in the other.
    _write(ref_dir, 1, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.01])}, grads_ref)
    _write(run_dir, 1, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([-0.01])}, grads_run)
    # Step 2: a real difference in w (and the bias stays excluded: it already diverged).
    _write(ref_dir, 2, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.02])}, grads_ref)
    _write(run_dir, 2, {"w": torch.tensor([1.0, 2.1]), "b": torch.tensor([-0.02])},
           {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([0.0])})
    rows = compare_runs(ref_dir, run_dir, [1.0, 0.9], [1.0, 0.9], steps=3, tol=FP32)
    assert [r.step for r in rows] == [1, 2]  # step 3 was never recorded
    assert rows[0].param_rel == 0.0 and rows[0].excluded == 1 and math.isclose(rows[0].raw_param_rel, 0.01, rel_tol=1e-5)
    assert rows[0].failures(FP32) == []
    assert "rounding level" in rounding_note(rows[:1], FP32, "adam")
    assert rows[1].worst_param == "w" and math.isclose(rows[1].param_rel, 0.05, rel_tol=1e-5)
    assert any("parameters" in f for f in rows[1].failures(FP32))


def test_step_failures_name_what_exceeds_the_tolerance() -> None:
    ok = StepDiff(1, 2.0, 2.0 + 1e-6, 1e-7, 1e-7, "w", 1e-6, "w")
    assert ok.failures(FP32) == []
    bad = StepDiff(1, 2.0, 2.1, 0.1, 0.2, "features.0.weight", 0.3, "head.weight")
    messages = bad.failures(FP32)
    assert len(messages) == 3 and "features.0.weight" in messages[1] and "head.weight" in messages[2]
    assert StepDiff(1, float("nan"), 1.0, 0, 0, "", 0, "").failures(FP32)  # NaN is never equal


def test_tolerances_are_looser_for_reduced_precision_and_can_be_overridden() -> None:
    assert FP32.params < TOLERANCES["fp16"].params < TOLERANCES["bf16"].params
    custom = tolerance_for("fp32", params=1e-3)
    assert custom.params == 1e-3 and math.isclose(custom.loss, 1e-3) and math.isclose(custom.grads, 1e-2)
    assert tolerance_for("bf16") is TOLERANCES["bf16"]
    # Step 1 starts from the same weights in both runs: its gradients are held tighter.
    bf16 = TOLERANCES["bf16"]
    assert bf16.grads_at(1) < bf16.grads_at(2) == bf16.grads_at(7)
    assert StepDiff(1, 1.0, 1.0, 0, 0, "", 5e-2, "g").failures(bf16)
    assert not StepDiff(2, 1.0, 1.0, 0, 0, "", 5e-2, "g").failures(bf16)
    assert "at step 1 (same weights)" in bf16.describe() and "at step 1" not in FP32.describe()


def test_adaptive_optimizers_allow_a_small_share_of_lr_per_step() -> None:
    adam = tolerance_for("fp32", optimizer="adam", lr=0.01)
    sgd = tolerance_for("fp32", optimizer="sgd", lr=0.01)
    assert sgd is FP32 and adam.params == FP32.params and adam.adaptive_lr == 0.01
    # 2.2e-6 apart (1.5e-5 of the largest weight) after 2 steps: 1.1e-4 of lr per step
    near = StepDiff(2, 1.0, 1.0, 2.2e-6, 1.5e-5, "w", 1e-5, "w")
    assert near.failures(FP32) and not near.failures(adam)
    assert "adam's steps are about lr" in adam.describe()
    # A whole step apart (an optimizer bug): far outside, and the message says both bounds.
    whole = StepDiff(2, 1.0, 1.0, 1e-2, 7e-2, "w", 1e-5, "w")
    [message] = whole.failures(adam)
    assert "or 4.0e-05 absolute after 2 step(s) of adam" in message
    assert StepDiff(2, 1.0, 1.0, float("nan"), float("nan"), "w", 0, "w").failures(adam)


def test_verdict_and_table() -> None:
    good = [StepDiff(s, 1.0, 1.0, 0.0, 1e-8, "w", 1e-8, "w") for s in (1, 2)]
    passed, line = equivalence_verdict(good, 2, 2, "ddp", FP32, failed_run=False)
    assert passed and line.startswith("verdict: PASS")
    assert not equivalence_verdict(good, 3, 2, "ddp", FP32, failed_run=False)[0]  # a step missing
    assert "finished 2 of 3" in equivalence_verdict(good, 3, 2, "ddp", FP32, failed_run=True)[1]
    bad = good + [StepDiff(3, 1.0, 1.5, 0.1, 0.1, "w", 0.1, "w")]
    passed, line = equivalence_verdict(bad, 3, 2, "ddp", FP32, failed_run=False)
    assert not passed and line.startswith("verdict: FAIL - from step 3")
    table = format_table(bad, 2, FP32)
    assert len(table) == 4 and "loss (2 procs)" in table[0]
    assert "exceeds tolerance" in table[3] and "exceeds" not in table[1]


def test_lock_step_holds_every_step_to_one_step_from_the_same_state() -> None:
    free = tolerance_for("bf16", optimizer="adam", lr=0.01)
    lock = free.per_step()
    # Every step's gradients come from the same weights: the step-1 bound at every step.
    assert lock.grads_at(7) == free.grads_at(1) < free.grads_at(7)
    # Adam's allowance is one step's, however many steps were taken.
    assert lock.adaptive_allowance(5) == free.adaptive_allowance(1) < free.adaptive_allowance(5)
    apart = StepDiff(5, 1.0, 1.0, 5e-5, 2e-2, "w", 1e-3, "w")    # 5e-5 absolute after step 5
    assert not apart.failures(free) and "after one step of adam" in apart.failures(lock)[0]
    assert "for one step from the same state" in lock.describe() and "optimizer state" in lock.describe()


def test_lock_step_leaves_out_noise_of_this_step_only(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    # Step 1: the bias's gradient is noise, and Adam moved it apart; step 2: a real gradient, 0.1 apart.
    _write(ref_dir, 1, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.01])},
           {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([3e-9])})
    _write(run_dir, 1, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([-0.01])},
           {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([-3e-9])})
    _write(ref_dir, 2, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.1])},
           {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([0.2])})
    _write(run_dir, 2, {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])},
           {"w": torch.tensor([0.5, -0.25]), "b": torch.tensor([0.2])})
    free = compare_runs(ref_dir, run_dir, [1.0, 1.0], [1.0, 1.0], steps=2, tol=FP32)
    lock = compare_runs(ref_dir, run_dir, [1.0, 1.0], [1.0, 1.0], steps=2, tol=FP32.per_step())
    assert free[1].param_rel == 0.0 and free[1].excluded == 1        # free-running: excluded for good
    assert lock[1].excluded == 0 and lock[1].worst_param == "b" and lock[1].param_rel > FP32.params
    assert not lock[0].failures(FP32.per_step()) and lock[1].failures(FP32.per_step())


def test_optimizer_states_are_compared_by_name_kind_by_kind() -> None:
    ref = {"w": {"step": torch.tensor(3.0), "exp_avg": torch.tensor([1.0, -2.0]), "exp_avg_sq": torch.tensor([4.0])},
           "b": {"step": torch.tensor(3.0), "exp_avg": torch.tensor([0.5]), "exp_avg_sq": torch.tensor([1.0])}}
    same = {n: {k: v.clone() for k, v in entry.items()} for n, entry in ref.items()}
    assert optimizer_state_diff(ref, same) == StateDiff()
    # A first moment 0.1 apart, relative to the largest first moment (2.0).
    moved = {**same, "b": {**same["b"], "exp_avg": torch.tensor([0.6])}}
    diff = optimizer_state_diff(ref, moved)
    assert abs(diff.rel - 0.05) < 1e-6 and diff.worst == "exp_avg of b" and not diff.unequal
    # A step counter must be equal; a parameter without state on one side counts as zeros.
    counted = {**same, "w": {**same["w"], "step": torch.tensor(4.0)}}
    assert optimizer_state_diff(ref, counted).unequal == ("step of w",)
    assert optimizer_state_diff(ref, {"w": same["w"]}).worst.endswith(" of b")
    zeros = {"z": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2)}}
    assert optimizer_state_diff({}, zeros) == StateDiff()
    row = with_state([StepDiff(1, 1.0, 1.0, 0, 0, "", 0, "")], {1: diff})[0]
    assert "optimizer state 5.00e-02 of its largest value" in row.failures(FP32.per_step())[0]
    assert "exp_avg of b, step 1" in state_line([row])


def test_the_trajectory_beside_a_lock_step_pass_is_explained_not_judged() -> None:
    lock = [StepDiff(s, 1.0, 1.0, 1e-8, 1e-7, "w", 1e-7, "w") for s in (1, 2)]
    drift = [StepDiff(1, 1.0, 1.0, 1e-8, 1e-7, "w", 1e-7, "w"), StepDiff(2, 1.0, 1.0, 1e-4, 2e-4, "w", 1e-6, "w")]
    passed, line = equivalence_verdict(lock, 2, 2, "pipeline", FP32.per_step(), False, trajectory=drift)
    assert passed and "each step from the same state" in line and "free-running: 2.0e-04 after 2" in line
    said = trajectory_line(drift, FP32, lockstep_passed=True)
    assert "beyond the free-running tolerance from step 2" in said and "not in what a step does" in said
    assert "within the free-running tolerance" in trajectory_line(lock, FP32, lockstep_passed=True)
