"""What a model saves besides its parameters, the step-0 and gradient-scale comparisons, and their words."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from scaleloop.verify import command
from scaleloop.verify.compare import TOLERANCES, compare_runs, gradient_ratio, initial_diff
from scaleloop.verify.diagnose import scale_cause
from scaleloop.verify.probes import LossSplit, Probes
from scaleloop.verify.recorder import step_file
from scaleloop.verify.report import equivalence_verdict
from scaleloop.verify.buffers import saved_buffers
from scaleloop.verify.sync import _tensors

FP32 = TOLERANCES["fp32"]


class TiedLM(nn.Module):
    """An embedding reused as the output head (one tensor, two state_dict keys), and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_is_no_buffer_and_counts_once() -> None:
    model = TiedLM()
    assert set(model.state_dict()) >= {"embed.weight", "head.weight"}
    assert sorted(saved_buffers(model)) == ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var"]
    tensors, params = _tensors(model)   # what --check sync hashes: the tied weight once, as a parameter
    assert "head.weight" not in tensors and "embed.weight" in params and "head.weight" in params
    assert sorted(n for n in tensors if n not in params) == sorted(saved_buffers(model))


def _write(run_dir: Path, step: int, params: dict, buffers: dict, grads: dict) -> None:
    run_dir.mkdir(exist_ok=True)
    torch.save({"params": params, "buffers": buffers, "grads": grads}, step_file(run_dir, step))


def test_buffers_are_compared_float_within_tolerance_counters_exactly(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    w, g = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 0.25])}
    count = {"n": torch.tensor(1)}
    _write(ref_dir, 1, w, {"ema": torch.tensor([1.0, 0.5]), **count}, g)
    _write(run_dir, 1, w, {"ema": torch.tensor([1.0, 0.5 + 1e-8]), **count}, g)   # rounding: equal
    _write(ref_dir, 2, w, {"ema": torch.tensor([1.0, 0.5]), "n": torch.tensor(2)}, g)
    _write(run_dir, 2, w, {"ema": torch.tensor([1.0, 0.6]), "n": torch.tensor(3)}, g)
    rows = compare_runs(ref_dir, run_dir, [1.0, 1.0], [1.0, 1.0], steps=2, tol=FP32)
    assert rows[0].failures(FP32) == []
    words = rows[1].failures(FP32)
    assert words[0].startswith("buffers 1.00e-01 of the largest buffer") and words[0].endswith("worst ema")
    assert words[1] == "buffer n differs"
    passed, verdict = equivalence_verdict(rows, 2, 2, "ddp", FP32, False)
    assert not passed and verdict.startswith("verdict: FAIL - from step 2: buffers")


def test_the_models_as_built_are_compared_at_step_0(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    _write(ref_dir, 0, {"w": torch.tensor([1.0, 2.0])}, {}, {})
    _write(run_dir, 0, {"w": torch.tensor([1.0, 2.0])}, {}, {})
    same = initial_diff(ref_dir, run_dir)
    assert same is not None and not same.differs(FP32)
    _write(run_dir, 0, {"w": torch.tensor([1.5, 2.0])}, {}, {})
    other = initial_diff(ref_dir, run_dir)
    assert other is not None and other.differs(FP32) and other.worst() == "w"
    assert initial_diff(ref_dir, tmp_path / "none") is None
    passed, verdict = equivalence_verdict([], 0, 2, "ddp", FP32, False, ["from step 0 (the models as built): x"])
    assert not passed and verdict == "verdict: FAIL - from step 0 (the models as built): x"


def test_a_constant_gradient_factor_is_found_and_named(tmp_path: Path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    grads = {"w": torch.tensor([0.5, -0.25, 2.0]), "b": torch.tensor([1e-3])}
    _write(ref_dir, 1, {}, {}, grads)
    _write(run_dir, 1, {}, {}, {n: g * 0.5 for n, g in grads.items()})
    ratio = gradient_ratio(ref_dir, run_dir, FP32)
    assert ratio == pytest.approx(0.5, rel=1e-6)
    cause = scale_cause(ratio, world=2, accumulate=1, probes=None)
    assert cause is not None and cause.title == ("a manual division (or multiplication) of the loss or gradients "
                                                 "by the world size")
    assert scale_cause(2.0, world=2, accumulate=1, probes=None).title == cause.title
    assert "accumulation" in scale_cause(0.25, world=2, accumulate=4, probes=None).title
    # A summed loss gives the same 1/N: its own rule names it.
    summed = Probes([], [], False, [], 0.0, LossSplit("sum", 2.0, 1.0, 2.0, 2))
    assert scale_cause(0.5, world=2, accumulate=1, probes=summed) is None
    # Equal gradients, or gradients that differ other than by one factor: no scale.
    _write(run_dir, 1, {}, {}, grads)
    assert gradient_ratio(ref_dir, run_dir, FP32) is None
    _write(run_dir, 1, {}, {}, {"w": grads["w"] * 0.5, "b": grads["b"]})
    assert gradient_ratio(ref_dir, run_dir, FP32) is None


@pytest.mark.parametrize("ending", [KeyboardInterrupt, RuntimeError])
def test_the_temporary_directory_is_removed_on_every_ending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            ending: type) -> None:
    monkeypatch.setattr(command.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ending):
        with command._report_root(None) as root:
            (root / "failure.json").write_text("{}")   # a failed run's report once kept it
            raise ending()
    assert list(tmp_path.iterdir()) == []
    with command._report_root(None) as root:
        pass
    assert not root.exists()


def test_a_buffer_may_differ_as_much_as_the_left_out_parameter_elements(tmp_path: Path) -> None:
    # Step 1: Adam moved a noise-gradient bias by +lr and -lr; step 2: the running mean after it follows.
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    grads_ref = {"w": torch.tensor([0.5]), "b": torch.tensor([3e-9])}
    grads_run = {"w": torch.tensor([0.5]), "b": torch.tensor([-3e-9])}
    _write(ref_dir, 1, {"w": torch.tensor([1.0]), "b": torch.tensor([0.01])}, {"mean": torch.tensor([0.0])}, grads_ref)
    _write(run_dir, 1, {"w": torch.tensor([1.0]), "b": torch.tensor([-0.01])}, {"mean": torch.tensor([0.0])}, grads_run)
    _write(ref_dir, 2, {"w": torch.tensor([1.0]), "b": torch.tensor([0.02])}, {"mean": torch.tensor([0.001])}, grads_ref)
    _write(run_dir, 2, {"w": torch.tensor([1.0]), "b": torch.tensor([-0.02])}, {"mean": torch.tensor([-0.001])},
           grads_run)
    rows = compare_runs(ref_dir, run_dir, [1.0, 1.0], [1.0, 1.0], steps=2, tol=FP32)
    assert rows[1].buffer_allowance == pytest.approx(0.02) and rows[1].failures(FP32) == []
    _write(run_dir, 2, {"w": torch.tensor([1.0]), "b": torch.tensor([-0.02])}, {"mean": torch.tensor([0.5])},
           grads_run)
    rows = compare_runs(ref_dir, run_dir, [1.0, 1.0], [1.0, 1.0], steps=2, tol=FP32)
    assert rows[1].failures(FP32)[0].startswith("buffers")
