"""The log rows (scaleloop.loop.rows).

A run's health on one process (and the loop around it): straggler detection, a diverging run,
data that is not finite, fp16 skipped steps, and the stop row of --max-steps.

A log row's tokens/s and MFU: the model FLOPs per token against a counted step, the peak only
where a datasheet gives it, and the columns a run writes: tokens/s of every position, or of the
real targets over -100 padding; MFU blank on the CPU, and computed from the peak where one is
known (a GPU's is faked here; the real one: test_gpu_mfu_is_written).
"""
from __future__ import annotations

import csv
import functools
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from scaleloop.bench.flops import train_flops_per_sample
from scaleloop.cli import main
from scaleloop.commands.doctor import diagnose
from scaleloop.config import TrainConfig
from scaleloop.data.info import DataInfo
from scaleloop.data.sampler import StepSampler
from scaleloop.loop.result import RunningLoss
from scaleloop.loop.rows import (Diverged, Stragglers, Throughput, attention_shape, blocks, first_bad,
                                 flops_per_token, multiplied_parameters, nonfinite_sample, per_rank_vector,
                                 throughput_of)
from scaleloop.loop.training import train
from scaleloop.models import SimpleNet, TinyGPT
from scaleloop.output import metrics
from scaleloop.output.metrics import read_metrics
from scaleloop.output.trackers import Tracker
from scaleloop.runtime.devices import Peak
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies import precision


CPU = DistEnv()


def quiet(_msg: str) -> None:
    pass


def small(tmp_path: Path, name: str = "run", **changes) -> TrainConfig:
    base = dict(data="random", n_samples=256, epochs=2, batch_size=64, out=str(tmp_path / name),
                progress=False, tensorboard=False, device="cpu", log_every=1)
    base.update(changes)
    return TrainConfig(**base).validate()


def rows(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_per_rank_vector_summed_over_ranks_is_a_gather() -> None:
    world = 3
    parts = [per_rank_vector([1.0, 2.0], [10.0 + r, 20.0 + r], DistEnv(rank=r, world_size=world))
             for r in range(world)]
    total = torch.stack(parts).sum(0).tolist()
    assert total[:2] == [3.0, 6.0]
    assert blocks(total, 2, world) == [[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]]
    assert first_bad([0.0, 7.0, 5.0]) == 5 and first_bad([0.0, 0.0]) is None


def test_a_consistently_slow_rank_is_reported_once_and_jitter_never() -> None:
    watch = Stragglers()
    # 4 steps per window of 40 ms each; rank 2 spends 30 ms of its own per step, the others 2 ms.
    slow = [0.008, 0.008, 0.120, 0.008]
    assert watch.window(slow, 4, 0.040, 4) is None                 # once could be a hiccup
    found = watch.window(slow, 4, 0.040, 8)
    assert found is not None and found.rank == 2 and found.first_step == 5 and found.last_step == 8
    assert found.slowest_s == pytest.approx(0.030) and found.others_s == pytest.approx(0.002)
    assert found.describe().startswith("straggler: rank 2 takes 30.0 ms per step for its own work")
    assert all(watch.window(slow, 4, 0.040, s) is None for s in (12, 16, 20))   # said once
    worse = [0.008, 0.008, 0.260, 0.008]
    assert watch.window(worse, 4, 0.070, 24).rank == 2                            # its lead doubled
    assert watch.worst is not None and watch.worst.slowest_s == pytest.approx(0.065)
    # A healthy run: ranks differ by a millisecond or two, or by much less than a step.
    calm = Stragglers()
    for s in range(10):
        assert calm.window([0.004, 0.010, 0.005], 4, 0.003, 4 * s) is None
        assert calm.window([0.40, 0.46, 0.41], 4, 0.120, 4 * s) is None        # 15 ms of 120 ms steps
    assert calm.window([0.1], 4, 0.1, 4) is None                               # one rank: nothing to compare


def test_running_loss_notes_the_first_nonfinite_step() -> None:
    running = RunningLoss()
    for step, value in [(1, 1.0), (2, 2.0), (3, float("nan")), (4, float("inf"))]:
        running.add(torch.tensor(value), 8, step)
    assert running.first_nonfinite_step() == 3
    clean = RunningLoss()
    clean.add(torch.tensor(1.0), 8, 1)
    assert clean.first_nonfinite_step() is None


def test_a_diverging_run_stops_without_a_nonfinite_checkpoint(tmp_path: Path) -> None:
    cfg = small(tmp_path, model="simplenet", optimizer="sgd", lr=1e10, checkpoint_every=2, keep_checkpoints=1,
                log_every=5)
    with pytest.raises(Diverged) as caught:
        train(cfg, CPU, log=quiet)
    text = str(caught.value)
    root = Path(cfg.checkpointing.out) / "checkpoints"
    kept = sorted(p.name for p in root.glob("step-*"))
    assert len(kept) == 1, kept
    good = int(kept[0].split("-")[1])
    assert f"the newest valid checkpoint is '{root / kept[0]}' (step {good})" in text, text
    assert text.startswith("the run diverged: the training loss became non-finite at step ") or \
        text.startswith("the run diverged: the training loss became nan at step "), text
    assert int(text.split(" at step ")[1].split()[0]) > good
    assert (root / "latest").read_text().strip() == kept[0]
    state = torch.load(root / kept[0] / "state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert "\n" not in text


# A user's dataset read from a file, one feature of one sample of which is NaN.
NAN_DATA = """
from pathlib import Path
import numpy as np, torch
from torch.utils.data import TensorDataset

def build():
    rows = np.loadtxt(Path(__file__).with_name("samples.csv"), delimiter=",", dtype=np.float32)
    return TensorDataset(torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, -1]).long()), None
"""


def test_nan_in_the_data_is_named_as_the_datas_fault_not_the_learning_rates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "the run diverged ... start over with a lower --lr or with --clip-grad 1.0".
    samples = torch.randn(256, 9, generator=torch.Generator().manual_seed(0))
    samples[:, -1] = (samples[:, 0] > 0).float()
    samples[37, 3] = float("nan")
    (tmp_path / "samples.csv").write_text("\n".join(",".join(map(str, row.tolist())) for row in samples) + "\n")
    (tmp_path / "nandata.py").write_text(NAN_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    code = main(["train", "--data", "nandata:build", "--epochs", "2", "--batch-size", "32", "--log-every", "1",
                 "--no-progress", "--no-tensorboard", "--device", "cpu", "--out", str(run)])
    out, err = capsys.readouterr()
    assert code == 2, err
    # Shuffled: step 1-8 of epoch 1, whichever holds sample 37, is the first with a NaN loss.
    step = next(s for s in range(8) if 37 in StepSampler(256, 32, seed=0).step_indices(0, s).tolist()) + 1
    assert err == (f"scaleloop: error: the training data is not finite: sample 37 has nan in its inputs (step {step}, "
                   "epoch 1, where the training loss became nan); stopped there and wrote no checkpoint of it; "
                   "no checkpoint was written before it; repair or leave out that sample (a lower --lr or "
                   "--clip-grad does not help)\n")
    assert json.loads((run / "failure.json").read_text())["kind"] == "usage"
    assert "the training data is not finite: sample 37 has nan" in diagnose(run).what


def test_a_nonfinite_sample_is_found_in_the_step_where_the_loss_began_only() -> None:
    def loader(dataset, sampler=None):
        return SimpleNamespace(dataset=dataset, sampler=sampler or StepSampler(len(dataset), 2, shuffle=False))

    targets = torch.zeros(6)
    targets[3] = float("-inf")
    pairs = torch.utils.data.TensorDataset(torch.ones(6, 2), targets)
    assert nonfinite_sample(loader(pairs), 1) is None          # samples 0 and 1
    assert nonfinite_sample(loader(pairs), 2) == "sample 3 has -inf in its target"
    mapping = [{"input_ids": torch.arange(3), "labels": torch.tensor([1.0, math.nan])}] * 2
    assert nonfinite_sample(loader(mapping), 1) == "sample 0 has nan in its target"
    stream = SimpleNamespace(steps_per_epoch=None)            # a stream's step cannot be read again
    assert nonfinite_sample(loader(pairs, stream), 2) is None


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_fp16_skipped_steps_are_counted_and_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A loss scale far too high for fp16: every step overflows and the scaler skips it.
    monkeypatch.setattr(precision.torch.amp, "GradScaler",
                        functools.partial(torch.amp.GradScaler, init_scale=2.0 ** 100))
    cfg = small(tmp_path, precision="fp16", max_steps=5, epochs=2, log_every=2)   # 4 steps per epoch
    result = train(cfg, CPU, log=quiet)
    assert result.steps == 5 and result.skipped_steps == 5
    logged = [(r["kind"], r["step"], r["skipped_steps"]) for r in rows(Path(cfg.checkpointing.out))]
    assert logged == [("step", "2", "2"), ("step", "4", "4"), ("epoch", "4", "4"), ("stop", "5", "5")]
    from scaleloop.loop.text import format_result
    assert "fp16 skipped steps  5 of 5" in format_result(result)


def test_a_resumed_max_steps_stop_leaves_one_epoch_row(tmp_path: Path) -> None:
    first = train(small(tmp_path, max_steps=3, epochs=2, log_every=2), CPU, log=quiet)
    assert first.steps == 3
    out = Path(first.run_dir)
    assert [(r["kind"], r["epoch"], r["step"]) for r in rows(out) if r["kind"] != "step"] == [("stop", "1", "3")]
    train(small(tmp_path, max_steps=None, epochs=2, log_every=2, resume="auto"), CPU, log=quiet)
    assert [(r["kind"], r["epoch"], r["step"]) for r in rows(out) if r["kind"] != "step"] == [
        ("stop", "1", "3"), ("epoch", "1", "4"), ("epoch", "2", "8")]
    steps = [r["step"] for r in rows(out) if r["kind"] == "step"]
    assert steps == sorted(set(steps), key=int)                     # no step twice either
    assert math.isfinite(float(rows(out)[-1]["train_loss"]))


# --- a log row's tokens/s and MFU -----------------------------------------------------------------

SCRIPTS = Path(__file__).resolve().parents[1] / "distributed" / "scripts"


@pytest.mark.parametrize("vocab, seq, d_model, layers, heads", [(256, 64, 128, 2, 4), (1000, 128, 64, 3, 8)])
def test_the_flops_per_token_are_those_a_counted_step_takes(vocab: int, seq: int, d_model: int, layers: int,
                                                            heads: int) -> None:
    """Counted over one forward and backward with the math attention (whose matmuls the counter
    sees): the estimate is the count, plus 6 x the biases and norms (N holds them; their
    element-wise work is not counted), to the FLOP."""
    model = TinyGPT(vocab, seq, d_model=d_model, n_layers=layers, n_heads=heads)
    x, y = torch.randint(0, vocab, (2, seq)), torch.randint(0, vocab, (2, seq))
    with sdpa_kernel(SDPBackend.MATH):
        counted = train_flops_per_sample(model, x, y, DataInfo("t", "lm", (seq,), vocab)) / seq
    elementwise = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert flops_per_token(model, seq) == counted + 6 * elementwise
    assert 6 * elementwise < 0.03 * counted   # which the convention neglects


def test_a_looked_up_table_is_no_multiplication_a_tied_one_is() -> None:
    model = TinyGPT(100, 16, d_model=32, n_layers=1, n_heads=4)
    every = sum(p.numel() for p in model.parameters())   # the tied table once
    assert multiplied_parameters(model) == every - 16 * 32   # the positions' table only is left out
    untied = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))
    assert multiplied_parameters(untied) == 32 * 100 + 100


def test_the_attention_shape_is_read_where_the_model_says_it() -> None:
    assert attention_shape(TinyGPT(50, 8, d_model=64, n_layers=3, n_heads=4)) == (3, 64)
    nanogpt = nn.Linear(2, 2)
    nanogpt.config = SimpleNamespace(n_layer=12, n_head=12, n_embd=768)   # nanoGPT's GPTConfig
    assert attention_shape(nanogpt) == (12, 768)
    gemma_like = nn.Linear(2, 2)
    gemma_like.config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, hidden_size=64, head_dim=32)
    assert attention_shape(gemma_like) == (2, 256)   # heads x head size, not the hidden width
    assert attention_shape(SimpleNet(4, 8, 2)) is None
    assert flops_per_token(SimpleNet(4, 8, 2), 16) == 6 * (4 * 8 + 8 + 8 * 2 + 2)


def test_a_transformers_models_shape_is_its_configs() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    assert attention_shape(model) == (2, 32)
    # Llama's input table is only looked up; its output layer (untied) multiplies.
    assert multiplied_parameters(model) == sum(p.numel() for p in model.parameters()) - 128 * 32


def test_the_row_values_divide_what_the_run_fixed_once() -> None:
    speed = Throughput(tokens_per_sample=64, flops_per_token=1e6, peak_flops_per_s=4e12)
    assert speed.tokens(10) == 640 and speed.tokens(10, counted=300.0) == 300.0
    assert speed.values(640.0, 2.0) == {"tokens_per_s": 320.0, "mfu": pytest.approx(320.0 * 1e6 / 4e12)}
    assert Throughput(64, 1e6, None).values(640.0, 2.0) == {"tokens_per_s": 320.0, "mfu": None}   # no peak: blank
    samples = Throughput()   # not token data
    assert samples.tokens(10) is None and samples.values(None, 2.0) == {}


def test_the_peak_is_a_datasheets_and_counts_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TinyGPT(64, 16, d_model=32, n_layers=1, n_heads=4)
    tokens = DataInfo("tokens", "lm", (16,), 64)
    on_cpu = throughput_of(model, tokens, "bf16", CPU)
    assert on_cpu == Throughput(16, flops_per_token(model, 16), None)   # a CPU has no datasheet figure
    assert throughput_of(SimpleNet(4, 8, 2), DataInfo("r", "classification", (4,), 2), "fp32", CPU) == Throughput()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpus = DistEnv(world_size=8, device=torch.device("cuda", 0))
    assert throughput_of(model, tokens, "bf16", gpus).peak_flops_per_s == 8 * 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Imaginary GPU 9000")
    assert throughput_of(model, tokens, "bf16", gpus).peak_flops_per_s is None   # unknown: blank, not a guess


class Recording(Tracker):
    """A tracker that keeps the rows it is handed."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.rows.append((step, dict(metrics)))


def small_run(tmp_path: Path, name: str, **changes) -> list[dict[str, str]]:
    """A run of a few steps in this process; its step rows of metrics.csv."""
    settings = dict(model="tinygpt", data="tokens", n_samples=192, seq_len=16, vocab_size=64, batch_size=32,
                    epochs=1, log_every=3, progress=False, tensorboard=False, device="cpu", checkpoints=False,
                    out=str(tmp_path / name), d_model=32, n_layers=1)
    train(TrainConfig(**{**settings, **changes}).validate(), CPU, log=lambda _line: None)
    return [row for row in read_metrics(tmp_path / name / "metrics.csv") if row["kind"] == "step"]


def test_token_rows_carry_tokens_per_s_and_mfu_where_a_peak_is_known(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every position of the built-in token data counts; on the CPU the MFU is blank; with a
    (faked) datasheet peak it is the tokens' model FLOPs over it."""
    rows = small_run(tmp_path, "cpu")
    assert len(rows) == 2
    for row in rows:
        assert float(row["tokens_per_s"]) == pytest.approx(16 * float(row["samples_per_s"]), rel=1e-12)
        assert row["mfu"] == "" and float(row["grad_norm"]) > 0
    monkeypatch.setattr("scaleloop.loop.rows.datasheet_peak", lambda device, precision: Peak(1e9, "a test's"))
    tracker = Recording()
    monkeypatch.setattr(metrics, "open_tracker", lambda *args, **kwargs: tracker)
    rows = small_run(tmp_path, "peak")
    per_token = flops_per_token(TinyGPT(64, 16, d_model=32, n_layers=1, n_heads=4), 16)
    for row in rows:
        assert float(row["mfu"]) == pytest.approx(float(row["tokens_per_s"]) * per_token / 1e9, rel=1e-12)
    # The tracker gets the same values under its names, row for row.
    tracked = [values for _, values in tracker.rows if "train/loss" in values]
    assert [(t["train/tokens_per_s"], t["train/mfu"]) for t in tracked] == \
        [(float(row["tokens_per_s"]), float(row["mfu"])) for row in rows]


def test_over_padding_the_tokens_are_the_real_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Targets of -100 from a random length on: the row counts the targets that enter the loss (one
    window of the whole epoch: all 160 samples), not 16 positions a sample."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.delitem(sys.modules, "usermodels", raising=False)
    from usermodels import padded_tokens

    train_set, _ = padded_tokens()
    real = int((train_set.tensors[1] != -100).sum())
    [row] = small_run(tmp_path, "padded", data="usermodels:padded_tokens", log_every=5)
    assert real < 16 * 160
    assert float(row["tokens_per_s"]) == pytest.approx(real / 160 * float(row["samples_per_s"]), rel=1e-12)


def test_rows_of_other_data_leave_the_token_columns_blank(tmp_path: Path) -> None:
    rows = small_run(tmp_path, "random", model="simplenet", data="random", d_model=None, n_layers=None)
    assert rows and all(row["tokens_per_s"] == "" and row["mfu"] == "" and row["samples_per_s"] for row in rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mfu_is_written(tmp_path: Path) -> None:
    """On a GPU of the datasheet table the rows carry an MFU, a share of the peak; on another GPU blank."""
    from scaleloop.runtime.devices import datasheet_peak

    rows = small_run(tmp_path, "gpu", device="cuda", precision="bf16", n_samples=1024, seq_len=128, vocab_size=256,
                     d_model=256, n_layers=2, log_every=4)
    known = datasheet_peak(torch.device("cuda"), "bf16") is not None
    for row in rows:
        assert float(row["tokens_per_s"]) == pytest.approx(128 * float(row["samples_per_s"]), rel=1e-9)
        assert (0 < float(row["mfu"]) < 1) if known else row["mfu"] == ""
