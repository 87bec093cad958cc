"""The probes that name a cause, and the rules that turn their findings into a diagnosis."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from scaleloop.config import TrainConfig
from scaleloop.models import ConvNet, SimpleNet, TinyGPT
from scaleloop.strategies.syncbn import convert_batchnorm
from scaleloop.verify.diagnose import failure_cause, fallback, name_causes, piece_groups
from scaleloop.verify.probes import (Probes, Randomness, batch_coupling, draws_random_numbers, dropout_layers,
                                     forward_randomness, loss_split, own_loss_split, run_probes, sample_draws,
                                     unsynced_batchnorm, unused_parameters)

torch.manual_seed(0)
IMAGES = torch.randn(16, 1, 8, 8)
LABELS = torch.arange(16) % 10


def mean_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def test_batchnorm_is_found_until_it_is_synchronised() -> None:
    conv = ConvNet(1, 10, (8, 8), width=4)
    assert unsynced_batchnorm(conv) == ["features.1 (BatchNorm2d)", "features.5 (BatchNorm2d)"]
    assert unsynced_batchnorm(convert_batchnorm(conv, torch.device("cpu"))) == []
    assert unsynced_batchnorm(SimpleNet(64, 8, 10)) == []


def test_random_draws_are_seen_in_the_forward_pass() -> None:
    dropping = nn.Sequential(nn.Flatten(1), nn.Linear(64, 8), nn.Dropout(0.2), nn.Linear(8, 10))
    assert dropout_layers(dropping) == ["2 (Dropout, p=0.2)"]
    assert draws_random_numbers(dropping, IMAGES)
    assert not draws_random_numbers(SimpleNet(64, 8, 10), IMAGES)

    class Noisy(nn.Module):  # random numbers without any Dropout module
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.flatten(1)[:, :10] + 0.1 * torch.randn(x.shape[0], 10)

    assert dropout_layers(Noisy()) == [] and draws_random_numbers(Noisy(), IMAGES)
    tokens = torch.randint(0, 16, (2, 8))
    assert not draws_random_numbers(TinyGPT(16, 8, d_model=16, n_layers=1, n_heads=2), tokens)
    assert draws_random_numbers(TinyGPT(16, 8, d_model=16, n_layers=1, n_heads=2, dropout=0.1), tokens)
    before = torch.get_rng_state()
    draws_random_numbers(dropping, IMAGES)
    assert torch.equal(before, torch.get_rng_state())  # the probe leaves the generator as it was


def test_unused_parameters_are_named() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(64, 10), nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x.flatten(1))

    assert unused_parameters(Branchy(), IMAGES, LABELS, mean_ce) == ["spare.weight", "spare.bias"]
    assert unused_parameters(SimpleNet(64, 8, 10), IMAGES, LABELS, mean_ce) == []


def test_batch_coupling_is_large_for_batchnorm_and_zero_for_an_mlp() -> None:
    assert batch_coupling(ConvNet(1, 10, (8, 8), width=4), IMAGES, [8, 8]) > 1e-3
    assert batch_coupling(SimpleNet(64, 8, 10), IMAGES, [8, 8]) < 1e-6


def test_loss_split_tells_a_mean_from_a_sum_from_a_per_piece_normalisation_from_a_batch_term() -> None:
    model = SimpleNet(64, 8, 10)
    groups = piece_groups(16, world=2, accumulate=2, ref_accumulate=1)
    assert groups == [[4, 4, 4, 4]]
    assert loss_split(model, mean_ce, IMAGES, LABELS, groups).kind == "mean"
    summed = loss_split(model, lambda o, y: F.cross_entropy(o, y, reduction="sum"), IMAGES, LABELS, groups)
    assert summed.kind == "sum" and abs(summed.whole - summed.total) < 1e-4
    labels = torch.tensor([0, 0, 0, 1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 1, 2, 3])  # class 0 unevenly spread
    masked = loss_split(model, lambda o, y: F.cross_entropy(o, y, ignore_index=0), IMAGES, labels, groups)
    assert masked.kind == "count" and masked.pieces == 4 and abs(masked.whole - masked.weighted_mean) > 1e-4
    weighted = loss_split(model, lambda o, y: F.cross_entropy(o, y, weight=torch.arange(1.0, 11.0)), IMAGES, labels,
                          groups)   # float32 class weights: the loss cannot take float64 outputs
    assert weighted.kind == "count"
    # Issue 41.11: a penalty on the batch's mean logit divides by no count; it was called a per-piece count.
    penalised = loss_split(model, lambda o, y: F.cross_entropy(o, y) + 10 * o.mean().pow(2), IMAGES, LABELS, groups)
    assert penalised.kind == "batch" and abs(penalised.whole - penalised.weighted_mean) > 1e-4
    cfg = TrainConfig(nproc=2, strategy="ddp", accumulate=2)
    causes = name_causes(cfg, world=2, accumulate=2, step_samples=16, probes=_probes(loss=penalised))
    assert [c.title for c in causes] == ["the loss holds a term of the whole batch that is not a mean over its samples"]
    assert "divides by a count" not in causes[0].detail and "per-sample terms" in causes[0].detail


def test_piece_groups_follow_the_loader_split() -> None:
    assert piece_groups(32, 2, 2, 2) == [[8, 8], [8, 8]]
    assert piece_groups(30, 2, 2, 2) == [[8, 7], [8, 7]]
    assert piece_groups(30, 2, 1, 1) == [[15, 15]]


def test_run_probes_on_a_batchnorm_model() -> None:
    probes = run_probes(ConvNet(1, 10, (8, 8), width=4), mean_ce, IMAGES, LABELS, [[8, 8]])
    assert probes.batchnorm and probes.random is False and probes.unused == []
    assert probes.loss is not None and probes.loss.kind == "mean"


def _probes(**changes: object) -> Probes:
    base = dict(batchnorm=[], dropout=[], random=False, unused=[], coupling=0.0, loss=None)
    return Probes(**{**base, **changes})  # type: ignore[arg-type]


def _titles(cfg: TrainConfig, probes: Probes, **kw: object) -> list[str]:
    return [c.title for c in name_causes(cfg, world=2, accumulate=cfg.parallel.accumulate, step_samples=32, probes=probes, **kw)]


def test_causes_are_named_where_they_apply() -> None:
    cfg = TrainConfig(nproc=2, strategy="ddp")
    bn = _probes(batchnorm=["features.1 (BatchNorm2d)"], coupling=0.1)
    assert _titles(cfg, bn) == ["BatchNorm without SyncBatchNorm"]
    assert _titles(cfg.replace(sync_batchnorm=True), bn) == []
    assert _titles(cfg, _probes(random=True, dropout=["net.2 (Dropout, p=0.5)"])) == ["dropout or RNG differs per rank"]
    split = loss_split(SimpleNet(64, 8, 10), lambda o, y: F.cross_entropy(o, y, ignore_index=0), IMAGES,
                       torch.tensor([0, 0, 0, 1, 2, 3, 4, 5, 0, 6, 7, 8, 9, 1, 2, 3]), [[8, 8]])
    assert _titles(cfg, _probes(loss=split)) == ["loss normalised per micro-batch instead of per global batch"]
    assert _titles(cfg, _probes(unused=["spare.weight"])) == ["unused parameters"]
    assert _titles(cfg, _probes(), no_grad=["spare.bias"]) == ["unused parameters"]
    # Every other strategy, and ddp with its options, trains them as one process does: not a cause.
    for other in (cfg.replace(strategy="allreduce"), cfg.replace(strategy="fsdp"),
                  cfg.replace(find_unused_parameters=True)):
        assert _titles(other, _probes(unused=["spare.weight"]), no_grad=["spare.bias"]) == []
    assert _titles(cfg, _probes(coupling=0.05)) == ["a layer couples the samples of a batch"]
    assert _titles(cfg, _probes(), step_problems=["step 1: ..."], content_problems=["rank 1 ..."]) == [
        "ranks loaded different data", "padded, duplicated or missing samples"]
    assert _titles(cfg, _probes()) == []
    assert "compare with --precision fp32" in fallback(cfg.replace(precision="bf16"), "step 2, w").detail
    cause = failure_cause([{"rank": 1, "step": 2, "error": "RuntimeError: boom\nmore"},
                           {"rank": 0, "step": 2, "error": "RuntimeError: first"}])
    assert cause.detail == "rank 0 at step 2: RuntimeError: first"


class _OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.g = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.randn(3, generator=self.g)


class _Reseeding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(5)
        return torch.nn.functional.dropout(self.lin(x), 0.5, self.training)


class _EveryOther(nn.Module):
    """An aux head added in every other call: no random number drawn."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.aux, self.calls = nn.Linear(4, 3), nn.Linear(4, 3), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) + (self.aux(x) if self.calls % 2 == 0 else 0)


class _NumpyNoise(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.from_numpy(np.random.standard_normal(3)).float()


def test_forward_randomness_tells_a_private_generator_from_reseeding_from_plain_dropout() -> None:
    x = torch.randn(6, 4)
    assert forward_randomness(_OwnGenerator(), x) == Randomness(private=True, reseeds=False)
    assert forward_randomness(_Reseeding(), x) == Randomness(private=False, reseeds=True)
    plain = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5))
    assert forward_randomness(plain, x) == Randomness(private=False, reseeds=False)
    # Issue 41.11: outputs that change from one pass to the next with no generator drawn are no randomness.
    assert forward_randomness(_EveryOther(), x) == Randomness(private=False, reseeds=False, stateful=True)
    assert forward_randomness(_NumpyNoise(), x) == Randomness(private=True, reseeds=False)
    reseeding = _Reseeding()
    state = torch.get_rng_state()
    forward_randomness(reseeding, x)
    assert torch.equal(torch.get_rng_state(), state)   # the caller's generator is left as it was


def test_sample_draws_finds_augmentation_when_a_sample_is_read() -> None:
    base = torch.randn(5, 3)
    plain = [(base[i], 0) for i in range(5)]

    class Global(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return base[i] + torch.randn(3), 0

    class Private(Global):
        g = torch.Generator().manual_seed(1)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return base[i] + torch.randn(3, generator=self.g), 0

    assert sample_draws(plain, 2) is None
    assert sample_draws(Global(), 2) == "global"
    assert sample_draws(Private(), 2) == "private"
def test_a_models_own_token_mean_over_padding_is_named() -> None:
    # verify_planted.TokenMeanLM: labels in, its own mean over the batch's real (not -100) tokens out.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed" / "scripts"))
    try:
        from verify_planted import TokenMeanLM, padded_lm
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    train, _ = padded_lm()
    ids, labels = train.tensors["input_ids"][:32], train.tensors["labels"][:32]
    model = TokenMeanLM()
    groups = piece_groups(32, 2, 2, 1)
    padded = own_loss_split(model, {"input_ids": ids}, labels, "labels", groups)
    assert padded is not None and padded.split.kind == "other" and padded.split.pieces == 4   # not told apart
    assert padded.positions == [96] * 4 and len(set(padded.real)) > 1   # 8 samples of 12 labels each
    probes = run_probes(model, mean_ce, {"input_ids": ids}, labels, groups, own_target="labels")
    assert probes.own_padded == padded and probes.loss is None
    cfg = TrainConfig(nproc=2, strategy="ddp", accumulate=2)
    causes = name_causes(cfg, world=2, accumulate=2, step_samples=32, probes=probes)
    assert [c.title for c in causes] == ["the model's own loss is a mean over each micro-batch's real tokens, and the "
                                         "micro-batches hold different counts of -100 padding"]
    assert "num_items_in_batch" in causes[0].detail and "return the logits without the loss" in causes[0].detail
    # Without padding the same model's loss is a sample-weighted mean; a run that counts is not probed.
    whole = own_loss_split(model, {"input_ids": ids}, ids, "labels", groups)
    assert whole is not None and whole.split.kind == "mean"
    assert run_probes(model, mean_ce, {"input_ids": ids}, labels, groups, own_target="labels",
                      counted=True).own_padded is None
