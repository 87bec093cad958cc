"""Building a run (scaleloop.loop.build).

The speed options (--compile, --channels-last, --fused-optimizer, --data-on-device,
--pin-memory, --persistent-workers): they train, they leave results as they were (bit for bit
where they change no arithmetic), and bad combinations fail in one line. The optimizer
build_optimizer makes: which tensors weight decay applies to (--decay-params), and Adam's
--betas and --eps. The learning rate: scaling, warm-up and schedules.
"""
from __future__ import annotations

import csv
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from scaleloop.cli import main
from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.loop.build import (LearningRate, build_optimizer, build_scheduler, check_decay_with_pipeline,
                                  describe_decay, describe_schedule, lr_factor, not_decayed, param_groups,
                                  scaled_lr)
from scaleloop.loop.training import RunResult, train
from scaleloop.models import SimpleNet
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies.base import Strategy


CPU = DistEnv()


def run(tmp_path: Path, name: str, **changes) -> RunResult:
    base = dict(data="random", n_samples=320, epochs=2, batch_size=64, out=str(tmp_path / name),
                progress=False, tensorboard=False, device="cpu", log_every=2)
    base.update(changes)
    return train(TrainConfig(**base).validate(), CPU, log=lambda _m: None)


def weights(result: RunResult) -> dict[str, torch.Tensor]:
    assert result.run_dir is not None
    return torch.load(result.run_dir / "model.pt", weights_only=True)


def metric_rows(result: RunResult) -> list[list[str]]:
    """metrics.csv without its timing columns."""
    assert result.run_dir is not None
    lines = (result.run_dir / "metrics.csv").read_text().splitlines()
    return [line.split(",")[:8] for line in lines]


def test_data_on_device_and_pin_memory_change_nothing_on_the_cpu(tmp_path: Path) -> None:
    ref = run(tmp_path, "ref")
    fast = run(tmp_path, "fast", data_on_device=True, pin_memory=False)
    assert fast.train_loss == ref.train_loss
    assert metric_rows(fast) == metric_rows(ref)
    a, b = weights(ref), weights(fast)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_channels_last_convnet_trains_like_contiguous(tmp_path: Path) -> None:
    common = dict(model="convnet", data="images", image_size=8, n_samples=128, batch_size=32, epochs=1)
    ref = run(tmp_path, "ref", **common)
    cl = run(tmp_path, "cl", channels_last=True, **common)
    # (Weights are not compared one by one: a convolution's bias before BatchNorm gets a gradient
    # of rounding noise, which Adam scales up to full steps, in either memory format.)
    assert abs(cl.train_loss - ref.train_loss) < 1e-4
    assert ref.test is not None and cl.test is not None and abs(cl.test.loss - ref.test.loss) < 1e-2
    assert weights(cl).keys() == weights(ref).keys()


def test_channels_last_on_a_model_without_convolutions_is_a_note(tmp_path: Path) -> None:
    messages: list[str] = []
    cfg = TrainConfig(data="random", n_samples=64, epochs=1, batch_size=32, out=str(tmp_path / "r"),
                      progress=False, tensorboard=False, device="cpu", channels_last=True).validate()
    train(cfg, CPU, log=messages.append)
    assert any("--channels-last changes nothing for simplenet" in m for m in messages)


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_fused_optimizer_trains_like_the_default(tmp_path: Path, optimizer: str) -> None:
    opt = build_optimizer(TrainConfig(optimizer=optimizer, fused_optimizer=True), SimpleNet(4, 8, 1).parameters())
    assert opt.defaults.get("fused") or opt.defaults.get("foreach")
    ref = run(tmp_path, "ref", optimizer=optimizer)
    fused = run(tmp_path, "fused", optimizer=optimizer, fused_optimizer=True)
    assert abs(fused.train_loss - ref.train_loss) < 1e-5
    a, b = weights(ref), weights(fused)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_unwrap_removes_torch_compile_and_ddp_style_wrappers() -> None:
    model = SimpleNet(4, 8, 1)
    strategy = Strategy(CPU)
    assert strategy.unwrap(torch.compile(model)) is model          # OptimizedModule: _orig_mod
    holder = torch.nn.Module()
    holder.module = torch.compile(model)                            # a wrapper around a compiled module
    assert strategy.unwrap(holder) is model
    assert list(strategy.unwrap(torch.compile(model)).state_dict()) == list(model.state_dict())


def _inductor_can_compile() -> str:
    """Empty if torch.compile works on this CPU, else why not."""
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "torch.compile on the CPU needs a C++ compiler (g++/clang++), and none is on the PATH"
    try:
        torch.compile(lambda t: t * 2 + 1)(torch.ones(2))
    except Exception as exc:  # noqa: BLE001 - any backend failure means: cannot test here
        return f"the inductor backend cannot compile here: {type(exc).__name__}: {exc}"[:300]
    return ""


@pytest.mark.slow
def test_compile_trains_to_the_eager_loss_and_saves_plain_keys(tmp_path: Path) -> None:
    reason = _inductor_can_compile()
    if reason:
        pytest.skip(reason)
    common = dict(n_samples=192, epochs=1, batch_size=64, hidden_dim=16, test_fraction=0.0, checkpoint_every=1)
    eager = run(tmp_path, "eager", **common)
    compiled = run(tmp_path, "compiled", compile=True, **common)
    assert abs(compiled.train_loss - eager.train_loss) < 1e-4
    a, b = weights(eager), weights(compiled)
    assert list(b) == list(a) and not any("_orig_mod" in k for k in b)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    ckpt = next((tmp_path / "compiled" / "checkpoints").glob("step-*/state.pt"))
    state = torch.load(ckpt, weights_only=True)
    assert list(state["model"]) == list(a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_speed_options_train_like_the_defaults(tmp_path: Path) -> None:
    env = DistEnv(device=torch.device("cuda"))
    common = dict(data="random", n_samples=256, epochs=1, batch_size=64, progress=False, tensorboard=False,
                  device="cuda")
    ref = train(TrainConfig(out=str(tmp_path / "ref"), **common).validate(), env, log=lambda _m: None)
    fast = train(TrainConfig(out=str(tmp_path / "fast"), data_on_device=True, fused_optimizer=True,
                             **common).validate(), env, log=lambda _m: None)
    assert abs(fast.train_loss - ref.train_loss) < 1e-4


@pytest.mark.parametrize("argv,message", [
    (["--persistent-workers"], "--persistent-workers keeps DataLoader worker processes"),
    (["--compile", "--strategy", "dp"], "--compile does not support --strategy dp"),
    (["--compile", "--strategy", "pipeline", "--nproc", "2"], "--compile does not support --strategy pipeline"),
])
def test_bad_combinations_fail_in_one_line(argv: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_data_on_device_needs_in_memory_tensors(tmp_path: Path) -> None:
    mod = tmp_path / "plain_data.py"
    mod.write_text(
        "import torch\n"
        "class Plain(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 32\n"
        "    def __getitem__(self, i): return torch.ones(4) * i, torch.tensor([float(i % 2)])\n"
        "def make(): return Plain()\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        cfg = TrainConfig(data="plain_data:make", epochs=1, batch_size=8, out=str(tmp_path / "r"), progress=False,
                          tensorboard=False, device="cpu", data_on_device=True).validate()
        with pytest.raises(UsageError, match="--data-on-device: keeping the data on the device needs in-memory"):
            train(cfg, CPU, log=lambda _m: None)
    finally:
        sys.path.remove(str(tmp_path))


def test_compile_on_cuda_names_a_missing_c_compiler(monkeypatch) -> None:
    """Triton builds its launcher with a C compiler: without one, one line before any CUDA work."""
    import importlib.util
    import shutil

    from scaleloop.errors import UsageError
    from scaleloop.loop.build import check_compile

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else real_find_spec(name, *a))
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(UsageError, match="needs a C compiler for Triton's launcher"):
        check_compile(torch.device("cuda"))


@pytest.mark.parametrize("optimizer,changes", [("adamw", dict(weight_decay=0.1, betas="0.9,0.95", eps=1e-6)),
                                               ("adam", dict(weight_decay=0.01)),
                                               ("sgd", dict(momentum=0.9, weight_decay=0.1)),
                                               ("sgd", dict(momentum=0.0))])
def test_default_optimizer_on_the_cpu_is_the_multi_tensor_loop_with_the_same_weights(optimizer: str,
                                                                                     changes: dict) -> None:
    # scaleloop's default on the CPU is foreach=True (faster); it must give what PyTorch's own
    # per-tensor default gives, bit for bit, decay groups included.
    from scaleloop.models import TinyGPT

    def trained(make_optimizer) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = TinyGPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1)
        opt = make_optimizer(model)
        tokens = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randint(32, (4, 8), generator=tokens)
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model.state_dict()

    cfg = TrainConfig(optimizer=optimizer, lr=1e-2, **changes)
    model = TinyGPT(vocab_size=32, seq_len=8, d_model=16, n_layers=1)
    assert build_optimizer(cfg, model.parameters(), model=model).defaults["foreach"] is True

    def per_tensor(model: torch.nn.Module) -> torch.optim.Optimizer:
        opt = build_optimizer(cfg, model.parameters(), model=model)
        for group in opt.param_groups:
            group["foreach"] = False   # PyTorch's own default on the CPU
        return opt

    a = trained(lambda model: build_optimizer(cfg, model.parameters(), model=model))
    b = trained(per_tensor)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the optimizer's parameter groups: which tensors weight decay applies to; Adam's --betas, --eps ---

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


# --- the learning rate: scaling, warm-up and schedules --------------------------------------------

def factor(step: int, schedule: str, total: int = 10, warmup: int = 0) -> float:
    return lr_factor(step, schedule=schedule, total_steps=total, warmup_steps=warmup)


# --- lr_factor -----------------------------------------------------------------------------

def test_constant_is_one_throughout() -> None:
    assert [factor(s, "constant") for s in (0, 5, 9)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["constant", "cosine", "step"])
def test_warmup_rises_linearly_to_the_peak(schedule: str) -> None:
    # from lr/N at the first step to lr at step N-1, whatever follows
    assert [factor(s, schedule, total=20, warmup=4) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4, schedule, total=20, warmup=4) == 1.0  # the schedule starts at its peak


def test_constant_after_warmup() -> None:
    assert [factor(s, "constant", total=10, warmup=2) for s in (2, 6, 9)] == [1.0, 1.0, 1.0]


def test_cosine_without_warmup() -> None:
    assert factor(0, "cosine") == 1.0
    assert factor(5, "cosine") == pytest.approx(0.5)
    assert factor(9, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.9)))
    assert factor(10, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert factor(50, "cosine") == pytest.approx(0.0, abs=1e-12)  # stays at the bottom past the end
    values = [factor(s, "cosine") for s in range(11)]
    assert values == sorted(values, reverse=True)


def test_cosine_with_warmup_spans_the_remaining_steps() -> None:
    # total 12, warm-up 2: the cosine runs over steps 2..12 (span 10)
    assert factor(2, "cosine", total=12, warmup=2) == 1.0
    assert factor(7, "cosine", total=12, warmup=2) == pytest.approx(0.5)
    assert factor(12, "cosine", total=12, warmup=2) == pytest.approx(0.0, abs=1e-12)


def test_step_schedule_drops_at_half_and_three_quarters() -> None:
    # total 10, warm-up 2: span 8, so x0.1 from 4 steps after the warm-up, x0.01 from 6 after
    got = [factor(s, "step", total=10, warmup=2) for s in range(10)]
    assert got[:2] == [0.5, 1.0]
    assert got[2:6] == [1.0, 1.0, 1.0, 1.0]
    assert got[6:8] == [pytest.approx(0.1)] * 2
    assert got[8:] == [pytest.approx(0.01)] * 2


def test_warmup_longer_than_the_run() -> None:
    assert factor(3, "cosine", total=4, warmup=10) == pytest.approx(0.4)
    assert factor(10, "cosine", total=4, warmup=10) == 1.0  # span clamps to 1: no division by zero


# --- --min-lr: the floor of the decaying schedules --------------------------------------------

def test_cosine_without_a_floor_is_the_plain_cosine_bit_for_bit() -> None:
    # floor 0 (the default) must give exactly the rates runs had before --min-lr existed
    for total, warmup in ((10, 0), (46, 5), (7, 10)):
        for s in range(total + 2):
            after, span = s - warmup, max(1, total - warmup)
            old = (s + 1) / warmup if warmup and s < warmup else \
                0.5 * (1.0 + math.cos(math.pi * min(1.0, after / span)))
            assert lr_factor(s, schedule="cosine", total_steps=total, warmup_steps=warmup, floor=0.0) == old


def test_cosine_decays_to_the_floor() -> None:
    got = [lr_factor(s, schedule="cosine", total_steps=10, warmup_steps=2, floor=0.1) for s in range(14)]
    assert got[:3] == [0.5, 1.0, 1.0]                                   # warm-up untouched
    assert got[6] == pytest.approx(0.1 + 0.9 * 0.5)                    # halfway: midway to the floor
    assert got[10:] == [pytest.approx(0.1)] * 4                         # at the end and past it: the floor
    assert got[2:] == sorted(got[2:], reverse=True) and min(got) == pytest.approx(0.1)


def test_step_drops_stop_at_the_floor() -> None:
    got = [lr_factor(s, schedule="step", total_steps=8, warmup_steps=0, floor=0.05) for s in range(8)]
    assert got == [1.0] * 4 + [pytest.approx(0.1)] * 2 + [0.05] * 2   # x0.01 would be below the floor


def test_scheduler_ends_at_min_lr() -> None:
    cfg = TrainConfig(lr=0.4, lr_schedule="cosine", min_lr=0.04, warmup_steps=2).validate()
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = build_scheduler(optimizer, cfg, 12)
    used = []
    for _ in range(13):   # one past the schedule's end: it stays at the floor
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert used[:3] == [pytest.approx(0.2), pytest.approx(0.4), pytest.approx(0.4)]
    assert used[11] > 0.04 and used[12] == pytest.approx(0.04)


def test_describe_schedule_names_where_it_ends() -> None:
    lr = LearningRate(0.1, "--lr as given")
    floor = TrainConfig(lr=0.1, lr_schedule="cosine", min_lr=1e-3).validate()
    assert describe_schedule(floor, lr, 50).endswith("cosine schedule over 50 steps, down to --min-lr 0.001")
    step = TrainConfig(lr=0.1, lr_schedule="step").validate()
    assert describe_schedule(step, lr, 50).endswith("step schedule over 50 steps")


# --- scaled_lr ---------------------------------------------------------------------------------

def test_no_scaling() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=256))
    assert lr.peak == 0.1 and lr.why == "--lr as given"


def test_linear_scaling() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=256, lr_scaling="linear", base_batch_size=64).validate())
    assert lr.peak == pytest.approx(0.4)
    assert lr.why == "0.1 x 256/64: linear scaling from --base-batch-size 64 to the global batch 256"


def test_sqrt_scaling() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=256, lr_scaling="sqrt", base_batch_size=64).validate())
    assert lr.peak == pytest.approx(0.2)
    assert lr.why == "0.1 x sqrt(256/64): sqrt scaling from --base-batch-size 64 to the global batch 256"


def test_scaling_down() -> None:
    lr = scaled_lr(TrainConfig(lr=0.1, batch_size=32, lr_scaling="linear", base_batch_size=128).validate())
    assert lr.peak == pytest.approx(0.025)


def test_scaling_needs_a_base_batch_size() -> None:
    with pytest.raises(UsageError, match="--base-batch-size"):
        TrainConfig(lr_scaling="linear").validate()


def test_describe_schedule() -> None:
    cfg = TrainConfig(lr=0.1, batch_size=256, lr_scaling="linear", base_batch_size=64,
                      lr_schedule="cosine", warmup_steps=5).validate()
    text = describe_schedule(cfg, scaled_lr(cfg), 100)
    assert text == ("0.4 (0.1 x 256/64: linear scaling from --base-batch-size 64 to the global batch 256), "
                    "5 warm-up steps, cosine schedule over 100 steps, down to 0")
    assert describe_schedule(TrainConfig(lr=0.1), scaled_lr(TrainConfig(lr=0.1)), 10) == "0.1 (--lr as given)"


# --- build_scheduler ---------------------------------------------------------------------------

def lrs_used(cfg: TrainConfig, total: int, peak: float = 0.4) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=peak)
    scheduler = build_scheduler(optimizer, cfg, total)
    used = []
    for _ in range(total):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return used


@pytest.mark.parametrize("schedule", ["constant", "cosine", "step"])
def test_scheduler_gives_each_step_its_factor(schedule: str) -> None:
    cfg = TrainConfig(lr_schedule=schedule, warmup_steps=3)
    used = lrs_used(cfg, 12)
    want = [0.4 * lr_factor(s, schedule=schedule, total_steps=12, warmup_steps=3) for s in range(12)]
    assert used == pytest.approx(want)
    assert used[0] == pytest.approx(0.4 / 3)


def test_scheduler_state_round_trip_continues_the_schedule() -> None:
    cfg = TrainConfig(lr_schedule="cosine", warmup_steps=2)
    whole = lrs_used(cfg, 10)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = build_scheduler(optimizer, cfg, 10)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    state, opt_state = scheduler.state_dict(), optimizer.state_dict()
    optimizer2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    scheduler2 = build_scheduler(optimizer2, cfg, 10)
    optimizer2.load_state_dict(opt_state)
    scheduler2.load_state_dict(state)
    rest = []
    for _ in range(4):
        rest.append(optimizer2.param_groups[0]["lr"])
        optimizer2.step()
        scheduler2.step()
    assert rest == pytest.approx(whole[6:])


# --- in a run ----------------------------------------------------------------------------------

def run_lrs(tmp_path: Path, **changes) -> tuple[list[str], list[dict[str, str]]]:
    cfg = TrainConfig(**{**dict(data="random", n_samples=256, epochs=1, batch_size=64, lr=1.0, optimizer="sgd",
                                out=str(tmp_path / "run"), progress=False, tensorboard=False, device="cpu",
                                log_every=1), **changes}).validate()
    lines: list[str] = []
    train(cfg, DistEnv(), log=lines.append)
    with open(tmp_path / "run" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    return lines, rows


def test_a_run_announces_its_learning_rate(tmp_path: Path) -> None:
    lines, _ = run_lrs(tmp_path, lr_scaling="linear", base_batch_size=32, warmup_steps=2)
    assert "learning rate 2 (1 x 64/32: linear scaling from --base-batch-size 32 to the global batch 64), " \
           "2 warm-up steps" in lines


def test_metrics_lr_column_is_the_rate_each_step_used(tmp_path: Path) -> None:
    _, rows = run_lrs(tmp_path, warmup_steps=4)
    assert [(r["step"], float(r["lr"])) for r in rows if r["kind"] == "step"] == [
        ("1", 0.25), ("2", 0.5), ("3", 0.75), ("4", 1.0)]


def test_epoch_row_lr_agrees_with_the_step_row_of_the_same_step(tmp_path: Path) -> None:
    _, rows = run_lrs(tmp_path, warmup_steps=8)  # one epoch of 4 steps, all in the warm-up
    by_kind = {(r["kind"], r["step"]): float(r["lr"]) for r in rows}
    assert by_kind[("step", "4")] == 0.5
    assert by_kind[("epoch", "4")] == by_kind[("step", "4")]


def test_constant_schedule_steps_like_lambdalr() -> None:
    """The constant schedule's cheap step leaves the same state and rate as LambdaLR's."""
    import torch

    from scaleloop.config import TrainConfig
    from scaleloop.loop.build import build_scheduler

    def pair():
        p = torch.nn.Parameter(torch.zeros(2))
        return torch.optim.SGD([p], lr=0.1)

    ref_opt, opt = pair(), pair()
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda step: 1.0)
    sched = build_scheduler(opt, TrainConfig(lr=0.1), total_steps=50)
    for _ in range(7):
        ref_opt.step(), opt.step()
        ref.step(), sched.step()
    assert sched.state_dict() == ref.state_dict()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1
    # A checkpoint of a constant run loaded into a warm-up run keeps the warm-up's schedule.
    warm = build_scheduler(pair(), TrainConfig(lr=0.1, warmup_steps=10), total_steps=50)
    warm.load_state_dict(sched.state_dict())
    assert warm.constant is False and warm.last_epoch == 7
