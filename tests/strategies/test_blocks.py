"""The one block finder (strategies/blocks.py): which modules are a model's blocks, for FSDP's
units, activation checkpointing and plan, on real third-party classes built from small configs
(nothing downloaded) and on the built-in models, and what a run says about them.

Two processes equal to one with these blocks: tests/distributed/test_thirdparty_models.py.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError
from scaleloop.loop.training import train
from scaleloop.models import BiggerNet, ConvNet, SimpleNet, TinyGPT
from scaleloop.runtime.dist import DistEnv
from scaleloop.strategies import FSDP
from scaleloop.strategies.blocks import find_blocks, untied_units
from scaleloop.strategies.recompute import checkpoint_blocks

SCRIPTS = Path(__file__).resolve().parents[1] / "distributed" / "scripts"


@pytest.fixture(autouse=True)
def no_group_left() -> Iterator[None]:
    yield
    if torch_dist.is_initialized():  # a failed test must not leave its one-rank group to the next one
        torch_dist.destroy_process_group()


def counted(model: nn.Module) -> tuple[str, str, int]:
    """What the finder says of ``model``: the blocks by class, how they were found, FSDP's units (with the root)."""
    found = find_blocks(model)
    return found.describe(), found.source, len(untied_units(model, found.modules)) + 1


# --- third-party models: their declarations ----------------------------------------------------
def _transformers() -> Any:
    return pytest.importorskip("transformers")


def llama() -> nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64))


def gpt2() -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=4, n_head=2,
                                          bos_token_id=0, eos_token_id=1))


def bert() -> nn.Module:
    t = _transformers()
    return t.BertForSequenceClassification(t.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                        num_attention_heads=2, intermediate_size=64,
                                                        max_position_embeddings=16, num_labels=3))


def qwen2() -> nn.Module:
    t = _transformers()   # grouped-query attention: 4 query heads share 2 key/value heads
    return t.Qwen2ForCausalLM(t.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64))


THIRD_PARTY: list[tuple[Callable[[], nn.Module], str, str, int]] = [
    # Before the finder: Llama 3 units (its whole decoder one) and 2 checkpointed blocks; GPT-2
    # (tied head) 7 units and 2 blocks; all without a word.
    (llama, "4 x LlamaDecoderLayer", "declared by _no_split_modules", 5),
    (gpt2, "4 x GPT2Block", "declared by _no_split_modules", 5),   # the tied embedding stays in the root
    # The classifier declares nothing; the BertModel inside it declares its embeddings and layers.
    (bert, "BertEmbeddings + 2 x BertLayer", "declared by _no_split_modules", 4),
    (qwen2, "3 x Qwen2DecoderLayer", "declared by _no_split_modules", 4),
]


@pytest.mark.parametrize("build, blocks, source, units", THIRD_PARTY, ids=lambda v: getattr(v, "__name__", None))
def test_a_transformers_model_gives_its_declared_layers(build: Callable[[], nn.Module], blocks: str, source: str,
                                                        units: int) -> None:
    model = build()
    assert counted(model) == (blocks, source, units)
    assert checkpoint_blocks(model) == len(find_blocks(model))


@pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="needs timm (a test extra)")
def test_a_timm_vit_gives_its_blocks() -> None:
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8,
                            depth=3)
    assert counted(vit) == ("3 x Block", "the largest stack of one class (blocks)", 4)


class _Layer(nn.Module):
    """A pre-norm transformer layer, the shape of timm's ViT Block (written here: timm is optional)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), nn.Linear(width, width)
        self.norm2, self.mlp = nn.LayerNorm(width), nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                                                  nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTLike(nn.Module):
    """timm's ViT layout: patch embedding, class token, an ``nn.Sequential`` of blocks, norm and head."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, width, kernel_size=8, stride=8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.blocks = nn.Sequential(*(_Layer(width) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1)
        return self.head(self.norm(self.blocks(x))[:, 0])


def test_a_stack_of_one_class_is_found_where_nothing_is_declared() -> None:
    assert counted(ViTLike()) == ("3 x _Layer", "the largest stack of one class (blocks)", 4)


# --- the built-in models keep what they had -----------------------------------------------------
def test_the_builtin_models_keep_their_blocks() -> None:
    assert counted(SimpleNet(64, 32, 10)) == ("2 x Linear", "the model's parts: it declares no blocks", 3)
    assert counted(BiggerNet(64, 32, 10))[0] == "3 x Linear"
    conv = ConvNet(1, 10, (8, 8))
    assert find_blocks(conv).modules == [conv.features, conv.head]
    gpt = TinyGPT(16, 8)
    assert counted(gpt) == ("2 x Block", "the largest stack of one class (blocks)", 3)
    one = TinyGPT(16, 8, n_layers=1)   # a ModuleList of one is still the model's stack
    assert find_blocks(one).modules == [one.blocks[0]]


# --- the rules' order and edges ----------------------------------------------------------------
class Inner(nn.Linear):
    pass


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.other = Inner(4, 4), nn.Linear(4, 4)


class Declares(nn.Module):
    _no_split_modules = ["Outer", "Inner"]

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Outer() for _ in range(3))
        self.loose = Inner(4, 4)   # a listed class outside the listed one: a block of its own


def test_declared_classes_give_the_outermost_modules_only() -> None:
    model = Declares()
    assert find_blocks(model).modules == [*model.layers, model.loose]
    assert counted(model)[:2] == ("3 x Outer + Inner", "declared by _no_split_modules")


def test_the_users_fsdp_blocks_comes_first() -> None:
    class Mine(Declares):
        def fsdp_blocks(self) -> list[nn.Module]:
            return [self.loose]

    model = Mine()
    assert find_blocks(model).modules == [model.loose]
    assert find_blocks(model).source == "named by fsdp_blocks()"


def test_declared_classes_the_model_lacks_fall_through_to_its_stack() -> None:
    model = Declares()
    model._no_split_modules = ["NotHere"]   # e.g. a subclass of the declared layer under another name
    assert counted(model)[:2] == ("3 x Outer", "the largest stack of one class (layers)")


def test_the_largest_stack_is_by_parameters_not_members() -> None:
    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(8))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(MoE() for _ in range(2))   # 2 members, but they hold the 8 experts

    model = Model()
    assert find_blocks(model).modules == list(model.layers)


def test_a_wrapping_sequential_of_one_is_not_a_stack() -> None:
    inner = SimpleNet(4, 8, 2)
    wrapped = nn.Sequential(inner.net)
    assert find_blocks(wrapped).modules == [inner.net[0], inner.net[2]]


def test_a_malformed_declaration_is_one_line() -> None:
    model = Declares()
    model._no_split_modules = 5
    with pytest.raises(UsageError, match=r"Declares._no_split_modules must be a list of class names, got 5"):
        find_blocks(model)


# --- what a run says --------------------------------------------------------------------------
def test_fsdp_and_checkpointing_name_the_blocks_in_the_runs_lines(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _transformers()
    monkeypatch.syspath_prepend(str(SCRIPTS))   # hfmodels.py: --model hfmodels:llama_tiny
    said: list[str] = []
    cfg = TrainConfig(model="hfmodels:llama_tiny", data="hfmodels:lm_data", strategy="fsdp",
                      activation_checkpointing=True, epochs=1, max_steps=2, batch_size=8, optimizer="sgd", lr=0.1,
                      progress=False, tensorboard=False, device="cpu", checkpoints=False,
                      out=str(tmp_path / "run")).validate()
    result = train(cfg, DistEnv(), log=said.append)
    assert result.strategy == "fsdp (5 units: 4 x LlamaDecoderLayer + root)"
    assert "fsdp (5 units: 4 x LlamaDecoderLayer + root) x 1 on cpu" in said[0], said[0]
    note = "activation checkpointing: 4 blocks (4 x LlamaDecoderLayer, declared by _no_split_modules) keep only"
    assert any(line.startswith(note) for line in said), said


def test_fsdp_says_when_the_model_gives_no_blocks() -> None:
    strategy = FSDP(DistEnv())
    try:
        strategy.setup(nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))
        assert strategy.describe() == "fsdp (1 unit: root)"
        assert strategy.details() == [
            "note: fsdp found no blocks in Linear, so the whole model is one unit, gathered whole on every rank; "
            "give the model an fsdp_blocks() method returning its blocks (e.g. its list of layers)"]
    finally:
        strategy.close()


def test_checkpointing_a_model_without_blocks_is_one_line() -> None:
    with pytest.raises(UsageError, match="Linear has none .*fsdp_blocks\\(\\) method"):
        checkpoint_blocks(nn.Linear(2, 2))
