"""A log row's tokens/s and MFU (scaleloop.loop.throughput): the model FLOPs per token against a
counted step, the peak only where a datasheet gives it, and the columns a run writes: tokens/s of
every position, or of the real targets over -100 padding; MFU blank on the CPU, and computed
from the peak where one is known (a GPU's is faked here; the real one: test_gpu_mfu_is_written)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Mapping

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from scaleloop.bench.flops import train_flops_per_sample
from scaleloop.config import TrainConfig
from scaleloop.data.info import DataInfo
from scaleloop.loop import throughput
from scaleloop.loop.throughput import Throughput, attention_shape, flops_per_token, multiplied_parameters, throughput_of
from scaleloop.loop.training import train
from scaleloop.models import SimpleNet, TinyGPT
from scaleloop.output import metrics
from scaleloop.output.metrics import read_metrics
from scaleloop.output.trackers import Tracker
from scaleloop.runtime.devices import Peak
from scaleloop.runtime.dist import DistEnv

SCRIPTS = Path(__file__).resolve().parents[1] / "distributed" / "scripts"
CPU = DistEnv()


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
    monkeypatch.setattr(throughput, "datasheet_peak", lambda device, precision: Peak(1e9, "a test's"))
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
