"""Exact losses over -100 padding (scaleloop.loop.padding), in one process: a step is the mean over
the real targets of the whole step, so cutting it into micro-batches (as ranks and --accumulate
do) trains the same model, with scaleloop's loss and with a Hugging Face causal LM's own; runs
without padding do not count. The 2-process runs: tests/distributed/test_thirdparty_models.py and
test_usermodels.py; verify's diagnosis: tests/verify/test_verify_probes.py."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from scaleloop import DictTensorDataset
from scaleloop.config import TrainConfig
from scaleloop.data.datasets import infer_info, targets_padded
from scaleloop.data.tokenfile import TokenFileDataset
from scaleloop.loop.build import build_run
from scaleloop.loop.padding import Counting, counting_for
from scaleloop.loop.step import Observer, steps_of, train_step
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv

SCRIPTS = Path(__file__).resolve().parents[1] / "distributed" / "scripts"
CPU = DistEnv(device=torch.device("cpu"))
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="needs transformers (a test extra)")


@pytest.fixture(autouse=True)
def scripts_importable():
    """``usermodels`` and ``hfmodels`` (tests/distributed/scripts) as ``--model``/``--data`` factories."""
    sys.path.insert(0, str(SCRIPTS))
    yield
    sys.path.remove(str(SCRIPTS))


class Samples(Dataset):
    """Read one sample at a time: what it holds is not known at start-up."""

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.y[i].clamp(min=0), self.y[i]


TOKENS = torch.arange(24).reshape(3, 8) % 5
PADDED = TOKENS.masked_fill(torch.arange(8) >= 6, -100)


def test_whether_targets_hold_padding_is_known_in_memory_or_when_said() -> None:
    assert targets_padded(TensorDataset(TOKENS, PADDED)) is True
    assert targets_padded(TensorDataset(TOKENS, TOKENS)) is False
    assert targets_padded(DictTensorDataset(input_ids=TOKENS, labels=PADDED)) is True
    assert targets_padded(TensorDataset(TOKENS.float(), TOKENS.float())) is False   # float targets: no index
    assert targets_padded(Samples(PADDED)) is None
    said = Samples(PADDED)
    said.padded = False   # type: ignore[attr-defined]
    assert targets_padded(said) is False
    assert TokenFileDataset.padded is False


class OwnLoss(nn.Module):
    """Takes ``labels`` and returns its own mean loss over the real ones: it cannot be told a count."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> dict[str, Any]:
        logits = self.embed(input_ids)
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_what_counts_follows_the_targets_and_the_loss() -> None:
    padded, plain = TensorDataset(TOKENS, PADDED), TensorDataset(TOKENS, TOKENS)
    lm = infer_info("t", padded)
    model = nn.Linear(1, 1)
    counting, notes = counting_for(lm, padded, model, None, False)
    assert counting == Counting(per_sample=8) and "each step's loss is the mean over the real targets" in notes[0]
    assert counting_for(lm, plain, model, None, False) == (None, [])              # no padding: nothing counts
    assert counting_for(lm, padded, model, "torch.nn.functional:cross_entropy", False) == (None, [])   # --loss
    # Not known (read one sample at a time): a language model's steps count anyway, without a note.
    assert counting_for(lm, Samples(PADDED), model, None, False) == (Counting(per_sample=8), [])
    classes = infer_info("c", TensorDataset(TOKENS[:, 0].float(), PADDED[:, -1]), task="classification")
    assert counting_for(classes, TensorDataset(TOKENS, PADDED[:, -1]), model, None, False)[0] == Counting(1)
    assert counting_for(classes, Samples(PADDED[:, -1]), model, None, False) == (None, [])
    # A model's own loss that cannot be told the count: not counted, and said.
    mapped = DictTensorDataset(input_ids=TOKENS, labels=PADDED)
    counting, notes = counting_for(infer_info("m", mapped), mapped, OwnLoss(), None, True)
    assert counting is None and "cannot be told the step's count of real targets" in notes[0]


def tinygpt(tmp_path: Path, name: str, **changes: Any) -> TrainConfig:
    return TrainConfig(**{**dict(model="tinygpt", data="usermodels:padded_tokens", batch_size=32, epochs=1,
                                 max_steps=3, optimizer="sgd", lr=0.5, progress=False, tensorboard=False,
                                 device="cpu", checkpoints=False, out=str(tmp_path / name)),
                          **changes}).validate()


def steps(cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Each step's loss as the micro-batches report it (read after the step), and the final weights."""
    run = build_run(cfg, CPU)
    run.model.train()
    run.loader.set_epoch(0)
    losses = []
    for micro_batches in steps_of(run.loader):
        kept, _ = train_step(run, micro_batches, Observer())
        sizes = [len(batch) for batch in micro_batches]
        losses.append(sum(float(loss) * n for loss, n in zip(kept, sizes)) / sum(sizes))
        if len(losses) == cfg.max_steps:
            break
    return losses, {k: v.clone() for k, v in run.model.state_dict().items()}


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    scale = max(v.abs().max().item() for v in a.values() if v.is_floating_point())
    return max((a[k] - b[k]).abs().max().item() for k in a if a[k].is_floating_point()) / scale


def test_micro_batches_over_padding_train_what_the_whole_batch_does(tmp_path: Path) -> None:
    whole_losses, whole = steps(tinygpt(tmp_path, "whole"))
    # 4 micro-batches of 8 samples, or 2 of 16: different counts of real targets each.
    for changes in ({"accumulate": 4}, {"accumulate": 2}):
        losses, split = steps(tinygpt(tmp_path, "split", **changes))
        assert relative(whole, split) < 1e-6, changes
        # What the step reports is the mean over the step's real targets, however it was cut.
        assert losses == pytest.approx(whole_losses, rel=1e-6), changes
    # The first step's loss is the mean over the batch's real targets of the model as built.
    cfg = tinygpt(tmp_path, "check")
    run = build_run(cfg, CPU)
    batch = next(iter(run.loader))
    x, y = batch
    with torch.no_grad():
        mean = F.cross_entropy(run.model(x).flatten(0, 1), y.flatten())   # ignore_index -100: the real ones
    assert whole_losses[0] == pytest.approx(float(mean), rel=1e-6)


def test_without_padding_nothing_is_counted(tmp_path: Path) -> None:
    run = build_run(tinygpt(tmp_path, "tokens", data="tokens", n_samples=96, seq_len=16, vocab_size=64), CPU)
    assert run.count is None


def hf(tmp_path: Path, name: str, **changes: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    cfg = TrainConfig(**{**dict(model="hfmodels:gpt2_tiny", data="hfmodels:lm_data_padded", batch_size=32, epochs=1,
                                max_steps=2, optimizer="sgd", lr=0.1, progress=False, tensorboard=False,
                                device="cpu", checkpoints=False, out=str(tmp_path / name)),
                         **changes}).validate()
    lines: list[str] = []
    result = train(cfg, CPU, log=lines.append)
    assert result.run_dir is not None
    return torch.load(result.run_dir / "model.pt", weights_only=True), lines


@needs_transformers
def test_a_hugging_face_causal_lm_is_told_the_count(tmp_path: Path) -> None:
    whole, lines = hf(tmp_path, "whole")
    assert any("told num_items_in_batch" in line for line in lines), lines
    split, _ = hf(tmp_path, "split", accumulate=4)
    assert relative(whole, split) < 1e-6
    # scaleloop's own loss on the same tokens (pairs: input, next token) trains the same model.
    pairs, _ = hf(tmp_path, "pairs", data="hfmodels:lm_pairs_padded", accumulate=2)
    assert relative(whole, pairs) < 1e-6


@needs_transformers
def test_a_model_that_ignores_the_count_trains_as_without_counting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    ignoring, _ = hf(tmp_path, "ignoring", model="hfmodels:gpt2_ignoring_count", accumulate=2)
    assert "the model's own loss did not follow num_items_in_batch" in capsys.readouterr().out
    import scaleloop.loop.build as build

    monkeypatch.setattr(build, "counting_for", lambda *args: (None, []))
    uncounted, _ = hf(tmp_path, "uncounted", model="hfmodels:gpt2_ignoring_count", accumulate=2)
    assert all(torch.equal(ignoring[k], uncounted[k]) for k in ignoring)
