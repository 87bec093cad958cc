"""The speed options (--compile, --channels-last, --fused-optimizer, --data-on-device,
--pin-memory, --persistent-workers): they train, they leave results as they were (bit for bit
where they change no arithmetic), and bad combinations fail in one line."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from scaleloop.cli import main
from scaleloop.config import TrainConfig
from scaleloop.runtime.dist import DistEnv
from scaleloop.errors import UsageError
from scaleloop.loop.build import build_optimizer
from scaleloop.loop.training import RunResult, train
from scaleloop.models import SimpleNet
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
    from scaleloop.loop.speed import check_compile

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
