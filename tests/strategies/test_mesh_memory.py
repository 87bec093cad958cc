"""Memory levers (issue 19 pt 5): --activation-checkpointing gives the same gradients with a lower
peak step memory on the CPU (measured by ``peak_step_bytes``), and --cpu-offload under fsdp trains
the same model; both refused, in one line, where they are not offered."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.loop.training import train
from scaleloop.models import TinyGPT
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.recompute import checkpoint_blocks, peak_step_bytes


def _step(model: nn.Module, tokens: torch.Tensor):
    def run() -> None:
        logits = model(tokens)
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return run


def test_checkpointed_blocks_give_the_same_gradients_with_less_peak_memory() -> None:
    torch.manual_seed(0)
    plain = TinyGPT(vocab_size=32, seq_len=32, d_model=32, n_layers=3, n_heads=4)
    recomputed = copy.deepcopy(plain)
    assert checkpoint_blocks(recomputed) == 3
    assert [n for n, _ in recomputed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    tokens = torch.randint(0, 32, (8, 32))
    peaks = [peak_step_bytes(_step(m, tokens)) for m in (plain, recomputed)]
    for p, q in zip(plain.parameters(), recomputed.parameters()):
        assert torch.equal(p.grad, q.grad)
    # Three blocks' activations (attention, the 4x wider MLP) are no longer all kept at once.
    assert 0 < peaks[1] < 0.6 * peaks[0], peaks


def test_a_model_without_blocks_is_told_in_one_line() -> None:
    with pytest.raises(UsageError, match="Linear has none"):
        checkpoint_blocks(nn.Linear(2, 2))


SMALL = dict(data="tokens", model="tinygpt", n_samples=24, seq_len=8, vocab_size=16, epochs=1, max_steps=2,
             batch_size=4, optimizer="sgd", lr=0.5, test_fraction=0.0, progress=False, tensorboard=False,
             device="cpu", checkpoints=False)


def test_fsdp_with_cpu_offload_and_checkpointing_trains_the_same_model(tmp_path: Path) -> None:
    said: list[str] = []
    levers = train(TrainConfig(**SMALL, strategy="fsdp", cpu_offload=True, activation_checkpointing=True,
                               out=str(tmp_path / "levers")).validate(), DistEnv(), log=said.append)
    plain = train(TrainConfig(**SMALL, out=str(tmp_path / "plain")).validate(), DistEnv(), log=lambda _m: None)
    assert levers.strategy.endswith("cpu offload)")
    assert any("activation checkpointing: 2 blocks" in line for line in said), said
    a, b = (torch.load(r.run_dir / "model.pt", weights_only=True) for r in (levers, plain))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.parametrize("changes, says", [
    (dict(cpu_offload=True, strategy="ddp", nproc=2), "use it with --strategy fsdp or --mesh"),
    (dict(activation_checkpointing=True, strategy="pipeline", nproc=2), "not offered with --strategy pipeline")])
def test_levers_are_refused_where_not_offered(changes: dict, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        TrainConfig(**changes).validate()
