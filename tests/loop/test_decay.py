"""Tests for scaleloop.loop.decay and the optimizer build_optimizer makes: which tensors weight
decay applies to (--decay-params), and Adam's --betas and --eps."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.loop.build import build_optimizer, check_decay_with_pipeline
from scaleloop.loop.decay import describe_decay, not_decayed, param_groups
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv


class RMSNorm(nn.Module):
    """A model's own norm class (as Hugging Face models have): known by its name."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Tiny(nn.Module):
    """Embedding, Linear (weight + bias), LayerNorm, a custom norm, a bare scalar: one of each kind."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(5, 4)
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.rms = RMSNorm(4)
        self.scale = nn.Parameter(torch.tensor(2.0))
        with torch.no_grad():   # no zeros (LayerNorm's bias starts at 0): decay must visibly move every tensor
            for p in self.parameters():
                p.uniform_(0.5, 1.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.rms(self.ln(self.fc(self.emb(idx)))) * self.scale


def names_in(groups, model: nn.Module) -> list[tuple[list[str], float]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [([name_of[id(p)] for p in g["params"]], g.get("weight_decay")) for g in groups]


def test_without_weight_decay_or_with_all_the_parameters_stay_one_list() -> None:
    model = Tiny()
    params = list(model.parameters())
    for decay, rule in ((0.0, "ndim2"), (0.0, "ndim2-no-embeddings"), (0.1, "all")):
        assert param_groups(params, decay, rule, model) == params


def test_ndim2_decays_matrices_and_embeddings_only() -> None:
    model = Tiny()
    groups = param_groups(model.parameters(), 0.1, "ndim2", model)   # in model.parameters() order
    assert names_in(groups, model) == [(["emb.weight", "fc.weight"], None),
                                       (["scale", "fc.bias", "ln.weight", "ln.bias", "rms.weight"], 0.0)]


def test_ndim2_no_embeddings_leaves_embeddings_out_too() -> None:
    model = Tiny()
    groups = param_groups(model.parameters(), 0.1, "ndim2-no-embeddings", model)
    assert names_in(groups, model)[0] == (["fc.weight"], None)
    assert not_decayed(model, "ndim2-no-embeddings")[id(model.emb.weight)] == "embeddings"


def test_a_model_of_matrices_only_keeps_one_group() -> None:
    model = nn.Linear(3, 3, bias=False)
    assert param_groups(model.parameters(), 0.1, "ndim2", model) == list(model.parameters())


def test_the_rule_needs_the_model() -> None:
    with pytest.raises(ValueError, match="needs the model"):
        param_groups(Tiny().parameters(), 0.1, "ndim2", None)


def test_describe_decay_counts_and_names_what_is_left_out() -> None:
    model = Tiny()
    assert describe_decay(model, 0.0, "ndim2") == ""
    assert describe_decay(model, 0.1, "ndim2") == ("0.1 on 2 of 7 tensors (ndim2: 2 or more dimensions); "
                                                   "not on 5: biases, norms, other tensors of under 2 dimensions")
    assert describe_decay(model, 0.1, "ndim2-no-embeddings").startswith(
        "0.1 on 1 of 7 tensors (ndim2-no-embeddings: 2 or more dimensions, not embeddings); not on 6: biases, "
        "norms, embeddings")
    assert describe_decay(model, 0.05, "all") == "0.05 on all 7 tensors (--decay-params all)"


def test_a_tied_weight_counts_once() -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5))
    model[1].weight = model[0].weight
    assert describe_decay(model, 0.1, "ndim2").startswith("0.1 on 1 of 2 tensors")


@pytest.mark.parametrize("rule", ["ndim2", "ndim2-no-embeddings", "all"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_only_the_chosen_tensors_shrink(optimizer: str, rule: str) -> None:
    # Zero gradients: Adam's update is 0 and SGD's is the decay alone, so a tensor moves only if it is decayed.
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(optimizer=optimizer, lr=0.1, weight_decay=0.5, decay_params=rule, momentum=0.0).validate()
    opt = build_optimizer(cfg, model.parameters(), model=model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    want = {"all": {n for n, _ in model.named_parameters()}, "ndim2": {"emb.weight", "fc.weight"},
            "ndim2-no-embeddings": {"fc.weight"}}[rule]
    assert moved == want
    # AdamW's decoupled decay and SGD's L2 term (no momentum) both take p -= lr x wd x p here
    assert torch.allclose(model.fc.weight, before["fc.weight"] * (1 - 0.1 * 0.5))


def test_betas_and_eps_reach_the_optimizer() -> None:
    model = Tiny()
    cfg = TrainConfig(optimizer="adamw", betas="0.9,0.95", eps=1e-6).validate()
    group = build_optimizer(cfg, model.parameters(), model=model).param_groups[0]
    assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-6


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_left_out_betas_and_eps_are_torchs_defaults(optimizer: str) -> None:
    model = Tiny()
    group = build_optimizer(TrainConfig(optimizer=optimizer), model.parameters(), model=model).param_groups[0]
    kind = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
    default = kind(model.parameters()).param_groups[0]
    assert (group["betas"], group["eps"]) == (default["betas"], default["eps"])


@pytest.mark.parametrize("changes", [dict(strategy="pipeline", nproc=2), dict(mesh="pp=2", nproc=2)])
def test_a_pipeline_with_weight_decay_on_some_tensors_is_refused(changes: dict) -> None:
    with pytest.raises(UsageError) as exc:
        check_decay_with_pipeline(TrainConfig(weight_decay=0.1, **changes).validate())
    assert "add --decay-params all" in str(exc.value) and "\n" not in str(exc.value)
    check_decay_with_pipeline(TrainConfig(weight_decay=0.1, decay_params="all", **changes).validate())
    check_decay_with_pipeline(TrainConfig(**changes).validate())   # no weight decay: nothing to leave out


def test_a_run_says_which_tensors_it_decays(tmp_path) -> None:
    cfg = TrainConfig(data="random", n_samples=64, epochs=1, batch_size=32, optimizer="adamw", weight_decay=0.1,
                      out=str(tmp_path / "run"), progress=False, tensorboard=False, device="cpu").validate()
    lines: list[str] = []
    result = train(cfg, DistEnv(), log=lines.append)
    # simplenet: two Linear layers, their weights decayed, their biases not
    assert "weight decay 0.1 on 2 of 4 tensors (ndim2: 2 or more dimensions); not on 2: biases" in lines
    assert result.weight_decay == "0.1 on 2 of 4 tensors (ndim2: 2 or more dimensions); not on 2: biases"
