"""Built-in models, and ``build_model`` which picks one (or a user factory) for a dataset.

Every built-in model offers ``as_sequential()``, the same computation as a flat run of layers
sharing the model's parameters, so that a pipeline-parallel strategy can cut it into stages
without knowing each class. ``TinyGPT`` keeps its transformer blocks in ``blocks`` so that a sharding
strategy can wrap one block at a time.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from scaleloop.data.info import DataInfo
from scaleloop.data.settings import MODEL_NAMES, TINYGPT_DEFAULTS, tinygpt_sizes
from scaleloop.errors import UsageError
from scaleloop.hfconfig import build_causal_lm, is_config_path
from scaleloop.plugins import call_factory, is_factory_spec, resolve_factory



class _FlatMLP(nn.Module):
    """Shared behaviour of the MLPs: flatten the sample, then run ``self.net``."""

    net: nn.Sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, *input_shape)`` to ``(batch, output_dim)``."""
        return self.net(x.flatten(1))

    def as_sequential(self) -> nn.Sequential:
        """The same computation as one flat ``nn.Sequential`` sharing this model's parameters."""
        return nn.Sequential(nn.Flatten(1), *self.net)


class SimpleNet(_FlatMLP):
    """The tutorial's MLP: Linear -> ReLU -> Linear, flattening image-shaped input first."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        # Kept under the tutorial's attribute name so its state_dict keys ("net.0.weight")
        # load into this class unchanged.
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, output_dim),
        )


class BiggerNet(_FlatMLP):
    """SimpleNet with one more hidden layer: Linear-ReLU-Linear-ReLU-Linear."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, output_dim),
        )


class ConvNet(nn.Sequential):
    """MNIST-style CNN: two Conv3x3-BatchNorm-ReLU-MaxPool2 blocks, then a linear head.

    Being an ``nn.Sequential`` (children ``features`` then ``head``), it runs as-is and can be
    split into stages; ``as_sequential()`` gives the finer, flat layer list.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        image_size: tuple[int, int],
        width: int = 32,
    ) -> None:
        height, breadth = image_size
        if height < 4 or breadth < 4:
            # Two 2x2 poolings would shrink a smaller image to nothing.
            raise ValueError(f"ConvNet needs images at least 4x4, got {height}x{breadth}")
        features = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        # MaxPool2d floors, so odd sizes (e.g. 7 -> 3) are handled the same way here.
        flat = 2 * width * (height // 4) * (breadth // 4)
        head = nn.Sequential(nn.Flatten(1), nn.Linear(flat, num_classes))
        super().__init__()
        self.features = features
        self.head = head

    def as_sequential(self) -> nn.Sequential:
        """The same computation as one flat ``nn.Sequential`` sharing this model's parameters."""
        return nn.Sequential(*self.features, *self.head)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, seq, d_model)`` to the same shape."""
        batch, seq, d_model = x.shape
        head_dim = d_model // self.n_heads
        # Three equal parts; under tensor parallelism (tp_plan) this rank's qkv output holds
        # only its own heads' q, k and v, so the head count is read from the width (-1).
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (batch, heads, seq, head_dim): the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(batch, seq, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, seq, d_model)`` to the same shape."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TokenEmbedding(nn.Module):
    """TinyGPT's input layer: token plus position embeddings (then dropout), sharing TinyGPT's modules."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding, drop: nn.Dropout, seq_len: int) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop, self.seq_len = tok_emb, pos_emb, drop, seq_len

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, seq)`` tokens to ``(batch, seq, d_model)``."""
        seq = tokens.shape[1]
        if seq > self.seq_len:
            raise ValueError(f"sequence length {seq} exceeds the model's seq_len {self.seq_len}")
        positions = torch.arange(seq, device=tokens.device)
        return self.drop(self.tok_emb(tokens) + self.pos_emb(positions))


class LMHead(nn.Module):
    """TinyGPT's output layer: final LayerNorm, then the (tied) projection to the vocabulary."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, seq, d_model)`` to ``(batch, seq, vocab_size)`` logits."""
        return self.lm_head(self.ln_f(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer language model.

    Input ``(batch, seq)`` int64 tokens with ``seq <= seq_len``; output ``(batch, seq, vocab)``
    logits for the next token at each position. The LM head shares the token embedding's
    weight, which saves ``vocab * d_model`` parameters.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int = TINYGPT_DEFAULTS.d_model,
        n_layers: int = TINYGPT_DEFAULTS.n_layers,
        n_heads: int = TINYGPT_DEFAULTS.n_heads,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        # Residual output projections are scaled down so the residual stream's variance
        # does not grow with depth (GPT-2's initialisation).
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layers))
        # Tied after init so the shared tensor keeps the embedding's initialisation.
        self.lm_head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # PyTorch's default (uniform, fan-in) init trains a small transformer noticeably
        # slower than the usual N(0, 0.02).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``(batch, seq)`` tokens to ``(batch, seq, vocab_size)`` logits."""
        x = self._embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def tp_plan(self, tp: int) -> dict[str, str]:
        """How tensor parallelism over ``tp`` ranks splits this model (docs/strategies.md,
        "Tensor parallelism"): in each block, the attention's fused q/k/v projection by output
        (whole heads per rank, ``colwise:3``) and its output projection by input (``rowwise``);
        the MLP's first Linear colwise, its second rowwise (Megatron-LM's split). Embeddings,
        LayerNorms and the tied output layer stay whole, so the logits are whole on every rank.
        ValueError if the heads or the MLP do not divide by ``tp``."""
        attn = self.blocks[0].attn if len(self.blocks) else None
        heads = attn.n_heads if attn is not None else 0
        if heads % tp:
            raise ValueError(f"its {heads} attention heads do not divide by tp={tp}; use a tp that divides {heads}")
        plan: dict[str, str] = {}
        for i in range(len(self.blocks)):
            plan.update({f"blocks.{i}.attn.qkv": "colwise:3", f"blocks.{i}.attn.proj": "rowwise",
                         f"blocks.{i}.mlp.0": "colwise", f"blocks.{i}.mlp.2": "rowwise"})
        return plan

    @property
    def _embedding(self) -> TokenEmbedding:
        return TokenEmbedding(self.tok_emb, self.pos_emb, self.drop, self.seq_len)

    def as_sequential(self) -> nn.Sequential:
        """The same computation as one flat ``nn.Sequential`` sharing this model's parameters:
        embedding, each block, head (the head's weight is the embedding's, tied)."""
        return nn.Sequential(self._embedding, *self.blocks, LMHead(self.ln_f, self.lm_head))


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def build_model(name: str, info: DataInfo, hidden_dim: int = 128, *, d_model: Optional[int] = None,
                n_layers: Optional[int] = None, n_heads: Optional[int] = None) -> nn.Module:
    """Build the model called ``name`` (or from a ``pkg.module:factory`` spec) for ``info``.

    Built-in names are case-insensitive (see ``MODEL_NAMES``); ``hidden_dim`` sizes the MLPs,
    ``d_model``, ``n_layers`` and ``n_heads`` TinyGPT (None: its default; given for another
    model, or a width the heads do not divide: ``UsageError``).
    A transformers ``config.json`` (or a directory holding one) builds its causal LM, randomly
    initialised, for token data (``scaleloop.hfconfig``).
    A factory is called with ``info`` if it takes a required argument, else with none, and
    must return an ``nn.Module``. Raises ``UsageError`` when the model cannot fit the data.
    """
    sizes = tinygpt_sizes(name, d_model, n_layers, n_heads)
    if is_factory_spec(name):
        model = _call_model_factory(name, info)
        if not isinstance(model, nn.Module):
            raise UsageError(
                f"--model {name!r} returned {type(model).__name__} ({model!r:.60}), "
                "not a torch.nn.Module; make the factory return the model"
            )
        return model

    if is_config_path(name):
        return _from_config(name, info)

    key = name.lower()
    if key not in MODEL_NAMES:
        raise UsageError(
            f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}, "
            "or give 'package.module:factory'"
        )
    if key == "tinygpt":
        if info.task != "lm":
            raise UsageError(
                f"model 'tinygpt' needs token data (task 'lm'); dataset {info.name!r} is a "
                f"{info.task} task; use --data tokens or a {info.task} model such as simplenet"
            )
        if info.num_classes is None:
            raise UsageError(f"model 'tinygpt' is sized by the vocabulary size, which dataset {info.name!r} does not "
                             f"say and one sample cannot tell: {_DECLARE.format(attr='vocab_size')}")
        return TinyGPT(vocab_size=info.num_classes, seq_len=info.input_shape[0], d_model=sizes.d_model,
                       n_layers=sizes.n_layers, n_heads=sizes.n_heads)
    if info.task == "lm":
        raise UsageError(
            f"model {key!r} cannot model token sequences from dataset {info.name!r}; "
            "use --model tinygpt"
        )

    if info.task == "none":
        raise UsageError(f"model {key!r} needs a target to learn from, and dataset {info.name!r} has none (its samples "
                         "have no 'labels' entry); give the samples labels, or use a model that returns its own loss")
    if info.num_classes is None:  # a classification whose classes one sample cannot tell
        raise UsageError(f"model {key!r} is sized by the number of classes, which dataset {info.name!r} does not "
                         f"say and one sample cannot tell: {_DECLARE.format(attr='num_classes')}, or use a model "
                         "factory (--model package.module:factory) that sizes its own output")
    output_dim = info.num_classes  # binary: one output per label (several: multi-label)
    if key == "convnet":
        shape = info.input_shape
        if len(shape) != 3:
            raise UsageError(
                f"model 'convnet' needs image data shaped (channels, height, width); dataset "
                f"{info.name!r} gives samples shaped {_shape(shape)}; use --model simplenet "
                "or an image dataset (digits, mnist, images)"
            )
        if shape[1] < 4 or shape[2] < 4:
            raise UsageError(
                f"model 'convnet' needs images at least 4x4; dataset {info.name!r} gives "
                f"{shape[1]}x{shape[2]}; use --model simplenet"
            )
        return ConvNet(shape[0], output_dim, (shape[1], shape[2]))

    input_dim = math.prod(info.input_shape)
    mlp = SimpleNet if key == "simplenet" else BiggerNet
    return mlp(input_dim, hidden_dim, output_dim)


#: How a dataset says what one sample cannot tell (docs/models-and-data.md, "Tasks").
_DECLARE = ("give the dataset a '{attr}' attribute, or return scaleloop.Datasets(train, test, "
            "scaleloop.DataInfo(name, task, input_shape, num_classes)) from the data factory")


def _count_of(info: DataInfo) -> str:
    return "vocabulary size" if info.task == "lm" else "number of classes"


def _attr_of(info: DataInfo) -> str:
    return "vocab_size" if info.task == "lm" else "num_classes"


def _from_config(name: str, info: DataInfo) -> nn.Module:
    """A transformers causal LM from config ``name`` (``scaleloop.hfconfig``) for token data."""
    if info.task != "lm":
        raise UsageError(f"--model {name}: a causal language model needs token data (task 'lm'); dataset "
                         f"{info.name!r} is a {info.task} task: use --data tokens or tokenfile")
    return build_causal_lm(name, seq_len=info.input_shape[0], vocab_size=info.num_classes)


def _call_model_factory(name: str, info: DataInfo) -> Any:
    """The model factory's result; when it fails while ``info.num_classes`` is unknown (None),
    most likely because it read it, one line says how the dataset can declare it."""
    factory = resolve_factory(name, "model")
    if info.num_classes is not None or info.task not in ("classification", "lm"):
        return call_factory(factory, info)
    try:
        return call_factory(factory, info)
    except (TypeError, ValueError) as exc:   # e.g. nn.Linear(d, None), nn.Embedding(None, d)
        raise UsageError(f"--model {name!r} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}) "
                         f"with info.num_classes None: dataset {info.name!r} does not say its {_count_of(info)} "
                         f"and one sample cannot tell: {_DECLARE.format(attr=_attr_of(info))}") from exc


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
