"""Tests for scaleloop.models: shapes, structure, causality, errors and user factories."""
from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch
from torch import nn

from scaleloop.data.info import DataInfo
from scaleloop.errors import UsageError
from scaleloop.models import (
    MODEL_NAMES,
    BiggerNet,
    ConvNet,
    SimpleNet,
    TinyGPT,
    build_model,
    count_parameters,
)

DIGITS = DataInfo("digits", "classification", (1, 8, 8), 10)
RANDOM = DataInfo("random", "binary", (20,), 1)
MNIST = DataInfo("mnist", "classification", (1, 28, 28), 10)
IMAGES = DataInfo("images", "classification", (3, 32, 32), 10)
TOKENS = DataInfo("tokens", "lm", (16,), 50)


def _batch(info: DataInfo, n: int = 4) -> torch.Tensor:
    if info.task == "lm":
        return torch.randint(0, info.num_classes, (n, *info.input_shape))
    return torch.randn(n, *info.input_shape)


def test_model_names_is_an_immutable_tuple() -> None:
    assert MODEL_NAMES == ("simplenet", "biggernet", "convnet", "tinygpt")
    assert isinstance(MODEL_NAMES, tuple)


@pytest.mark.parametrize(
    "name, info, expected",
    [
        ("simplenet", DIGITS, (4, 10)),
        ("simplenet", RANDOM, (4, 1)),
        ("simplenet", MNIST, (4, 10)),
        ("biggernet", DIGITS, (4, 10)),
        ("biggernet", RANDOM, (4, 1)),
        ("biggernet", IMAGES, (4, 10)),
        ("convnet", DIGITS, (4, 10)),
        ("convnet", MNIST, (4, 10)),
        ("convnet", IMAGES, (4, 10)),
        ("tinygpt", TOKENS, (4, 16, 50)),
    ],
)
def test_output_shapes(name: str, info: DataInfo, expected: tuple[int, ...]) -> None:
    model = build_model(name, info)
    out = model(_batch(info))
    assert out.shape == expected
    assert torch.isfinite(out).all()


def test_names_are_case_insensitive() -> None:
    assert isinstance(build_model("SimpleNet", DIGITS), SimpleNet)
    assert isinstance(build_model("CONVNET", DIGITS), ConvNet)


def test_simplenet_has_the_tutorial_structure() -> None:
    model = build_model("simplenet", RANDOM, hidden_dim=64)
    assert isinstance(model, SimpleNet)
    layers = list(model.net)
    assert [type(m) for m in layers] == [nn.Linear, nn.ReLU, nn.Linear]
    assert (layers[0].in_features, layers[0].out_features) == (20, 64)
    assert (layers[2].in_features, layers[2].out_features) == (64, 1)
    # The tutorial's state_dict keys, so its checkpoints load unchanged.
    assert set(model.state_dict()) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}


def test_simplenet_flattens_image_input() -> None:
    model = build_model("simplenet", DIGITS)
    assert model.net[0].in_features == 64
    x = torch.randn(3, 1, 8, 8)
    assert torch.equal(model(x), model(x.flatten(1)))


def test_biggernet_has_one_more_hidden_layer() -> None:
    model = build_model("biggernet", DIGITS, hidden_dim=32)
    assert isinstance(model, BiggerNet)
    assert [type(m) for m in model.net] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    assert (model.net[2].in_features, model.net[2].out_features) == (32, 32)
    assert count_parameters(model) > count_parameters(build_model("simplenet", DIGITS, 32))


def test_convnet_structure() -> None:
    model = build_model("convnet", MNIST)
    assert isinstance(model, nn.Sequential)
    assert [name for name, _ in model.named_children()] == ["features", "head"]
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(nn.BatchNorm2d) == 2
    assert kinds.count(nn.Conv2d) == 2
    assert kinds.count(nn.MaxPool2d) == 2
    # 28 -> 14 -> 7 after the two poolings, with 64 channels.
    assert model.head[-1].in_features == 64 * 7 * 7


@pytest.mark.parametrize("model", [
    SimpleNet(64, 16, 10),
    BiggerNet(64, 16, 10),
    ConvNet(1, 10, (8, 8), width=8),
])
def test_as_sequential_matches_and_shares_parameters(model: nn.Module) -> None:
    model.eval()
    seq = model.as_sequential()
    assert isinstance(seq, nn.Sequential)
    assert not any(isinstance(m, nn.Sequential) for m in seq)
    x = torch.randn(2, 1, 8, 8)
    assert torch.allclose(seq(x), model(x))
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}


def test_convnet_rejects_too_small_images() -> None:
    with pytest.raises(ValueError):
        ConvNet(1, 10, (3, 8))
    with pytest.raises(UsageError, match="4x4"):
        build_model("convnet", DataInfo("tiny", "classification", (1, 2, 2), 10))


def test_tinygpt_structure_and_tied_head() -> None:
    model = build_model("tinygpt", TOKENS)
    assert isinstance(model, TinyGPT)
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    assert model.lm_head.weight is model.tok_emb.weight
    # Tied weight counted once.
    assert count_parameters(model) == sum(p.numel() for p in set(model.parameters()))


def test_tinygpt_is_causal() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=50, seq_len=16, d_model=32, n_layers=2, n_heads=4).eval()
    tokens = torch.randint(0, 50, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 50
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tinygpt_takes_shorter_sequences_and_rejects_longer() -> None:
    model = TinyGPT(vocab_size=50, seq_len=16, d_model=32, n_heads=4)
    assert model(torch.randint(0, 50, (3, 5))).shape == (3, 5, 50)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.randint(0, 50, (1, 17)))


def test_tinygpt_trains_one_step() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=50, seq_len=16, d_model=32, n_heads=4, dropout=0.1)
    tokens = torch.randint(0, 50, (4, 17))
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_count_parameters() -> None:
    assert count_parameters(SimpleNet(20, 8, 1)) == 20 * 8 + 8 + 8 * 1 + 1
    frozen = SimpleNet(20, 8, 1)
    frozen.net[0].requires_grad_(False)
    assert count_parameters(frozen) == 8 + 1


def test_unknown_name() -> None:
    with pytest.raises(UsageError) as exc:
        build_model("resnet", DIGITS)
    message = str(exc.value)
    assert "unknown model 'resnet'" in message
    assert "simplenet, biggernet, convnet, tinygpt" in message
    assert "package.module:factory" in message
    assert "\n" not in message


def test_convnet_on_vector_data() -> None:
    with pytest.raises(UsageError) as exc:
        build_model("convnet", RANDOM)
    message = str(exc.value)
    assert "(channels, height, width)" in message
    assert "'random'" in message and "(20,)" in message
    assert "--model simplenet" in message
    assert "\n" not in message


@pytest.mark.parametrize("info", [DIGITS, RANDOM])
def test_tinygpt_on_non_lm_data(info: DataInfo) -> None:
    with pytest.raises(UsageError, match="--data tokens"):
        build_model("tinygpt", info)


@pytest.mark.parametrize("name", ["simplenet", "biggernet", "convnet"])
def test_non_lm_models_on_lm_data(name: str) -> None:
    with pytest.raises(UsageError, match="--model tinygpt"):
        build_model(name, TOKENS)


def test_factory_not_importable() -> None:
    with pytest.raises(UsageError, match="cannot import module 'no_such_module_xyz'"):
        build_model("no_such_module_xyz:make", DIGITS)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write ``mymod.py`` into tmp_path and make it importable, fresh for each test."""

    def write(source: str) -> None:
        (tmp_path / "mymod.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    # Each test writes its own mymod; a cached one from an earlier test must not be reused.
    sys.modules.pop("mymod", None)
    yield write
    sys.modules.pop("mymod", None)


def test_factory_returning_non_module(user_module) -> None:
    user_module("""
        def make():
            return 42
    """)
    with pytest.raises(UsageError) as exc:
        build_model("mymod:make", DIGITS)
    message = str(exc.value)
    assert "returned int" in message and "nn.Module" in message


def test_factory_with_no_arguments(user_module) -> None:
    user_module("""
        from torch import nn

        def make():
            return nn.Linear(64, 10)
    """)
    model = build_model("mymod:make", DIGITS)
    assert isinstance(model, nn.Linear)
    assert (model.in_features, model.out_features) == (64, 10)


def test_factory_taking_info(user_module) -> None:
    user_module("""
        import math
        from torch import nn

        def make(info):
            return nn.Sequential(
                nn.Flatten(), nn.Linear(math.prod(info.input_shape), info.num_classes)
            )
    """)
    model = build_model("mymod:make", MNIST)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


# --- TinyGPT's sizes: --d-model, --n-layers, --n-heads ------------------------------------------

def test_tinygpt_takes_its_sizes_and_keeps_the_defaults_of_those_not_given() -> None:
    model = build_model("tinygpt", TOKENS, d_model=48, n_layers=3, n_heads=6)
    assert (model.tok_emb.embedding_dim, len(model.blocks), model.blocks[0].attn.n_heads) == (48, 3, 6)
    model = build_model("tinygpt", TOKENS, n_layers=1)
    assert (model.tok_emb.embedding_dim, len(model.blocks), model.blocks[0].attn.n_heads) == (128, 1, 4)


@pytest.mark.parametrize("name, sizes, says", [
    ("simplenet", dict(d_model=64), "--d-model 64 sizes the built-in --model tinygpt only, not --model simplenet"),
    ("mymod:make", dict(n_layers=2, n_heads=2), "--n-layers 2 --n-heads 2 size the built-in --model tinygpt only"),
    ("tinygpt", dict(d_model=130), "--d-model 130 must be divisible by --n-heads 4"),
    ("tinygpt", dict(n_heads=0), "--n-heads must be a positive integer"),
])
def test_sizes_that_cannot_apply_are_refused_in_one_line(name: str, sizes: dict, says: str) -> None:
    with pytest.raises(UsageError) as exc:
        build_model(name, TOKENS, **sizes)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_the_sizes_are_saved_with_the_run_and_rebuilt_from_it(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``scaleloop sample`` and a resumed run rebuild the model from config.toml; other sizes on
    resume are refused in one line; a config.toml from before the sizes existed builds today's TinyGPT."""
    from scaleloop.cli import main
    from scaleloop.config import TrainConfig, load_toml, resolve, to_toml
    from scaleloop.loop.build import build_data_and_model
    from scaleloop.sampling import sample

    run = tmp_path / "run"
    base = ["train", "--no-progress", "--tracker", "none", "--out", str(run)]
    assert main([*base, "--model", "tinygpt", "--data", "tokens", "--n-samples", "64", "--seq-len", "16",
                 "--batch-size", "16", "--device", "cpu", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
                 "--max-steps", "1"]) == 0
    assert len(sample(run, "1 2 3", max_new_tokens=4)[0].split()) == 7   # the weights fit the rebuilt model
    capsys.readouterr()
    assert main([*base, "--max-steps", "2", "--n-heads", "4"]) == 2
    err = capsys.readouterr().err
    assert "trained with --n-heads 2, this run asks for --n-heads 4" in err and len(err.splitlines()) == 1
    assert main([*base, "--max-steps", "2"]) == 0   # without them: the saved sizes
    assert load_toml(run / "config.toml")["d_model"] == 32

    saved = to_toml(TrainConfig(model="tinygpt", data="tokens", n_samples=64, seq_len=16))
    older = "".join(line for line in saved.splitlines(keepends=True)
                    if not line.lstrip("# ").startswith(("d_model", "n_layers", "n_heads")))
    assert "d_model" not in older
    (tmp_path / "older.toml").write_text(older)
    _, model = build_data_and_model(resolve(load_toml(tmp_path / "older.toml"), {}))
    assert (model.tok_emb.embedding_dim, len(model.blocks), model.blocks[0].attn.n_heads) == (128, 2, 4)
