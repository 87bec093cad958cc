"""Real third-party models from small configs (nothing downloaded), for ``--model hfmodels:NAME``.

Hugging Face ``transformers``: GPT-2-, Llama- and Qwen2-style causal LMs on token batches and a
BERT-style classifier on sentence batches, as mappings with ``labels`` (the models compute their
own loss) or, for the LMs, as ``(input_ids, next tokens)`` pairs (``lm_pairs``: the pipeline's).
``timm``: a small ResNet and a small ViT (``pretrained=False``) on 3x32x32 images.
Dropout is off: with it, every rank draws its own masks and N ranks cannot equal 1.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from scaleloop import DictTensorDataset

VOCAB, SEQ = 64, 16


def gpt2_tiny(info: Any = None) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def llama_tiny(info: Any = None) -> torch.nn.Module:
    """A Llama-style causal LM (grouped-query attention, rotary positions, untied head) of 4 decoder
    layers, which its ``_no_split_modules`` names as the blocks (strategies/blocks.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=None))


def qwen2_tiny(info: Any = None) -> torch.nn.Module:
    """A Qwen2 causal LM (grouped-query attention with q/k/v biases, rotary positions, tied head)
    of 4 decoder layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=None))


def gpt2_ignoring_count(info: Any = None) -> torch.nn.Module:
    """gpt2_tiny whose forward drops ``num_items_in_batch``: its loss stays a mean over each
    micro-batch's real tokens, though it looks like a model that can be told the count."""
    from transformers import GPT2LMHeadModel

    class IgnoresCount(GPT2LMHeadModel):
        def forward(self, *args: Any, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
            return super().forward(*args, **kwargs)

    return IgnoresCount(gpt2_tiny().config)


def bert_tiny(info: Any = None) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=SEQ, num_labels=3,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    ids[:, 1::2] = (ids[:, ::2] + 1) % VOCAB  # every other token follows from the one before
    lengths = torch.randint(SEQ // 2, SEQ + 1, (n, 1), generator=g)
    return ids, (torch.arange(SEQ) < lengths).long()


def lm_data() -> tuple[DictTensorDataset, DictTensorDataset]:
    """Causal LM batches: ``labels`` are the input ids (the model shifts them). No padding: the
    model's own loss is a mean per token, and with equal token counts per sample that is the
    per-sample mean scaleloop weights micro-batches by (with padding, see lm_data_padded)."""
    ids, _ = _tokens(240, 0)
    parts = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return (DictTensorDataset({k: v[:192] for k, v in parts.items()}),
            DictTensorDataset({k: v[192:] for k, v in parts.items()}))


def lm_data_padded() -> tuple[DictTensorDataset, DictTensorDataset]:
    """As lm_data, with padding (-100 labels): token counts differ between samples, and so between
    micro-batches (scaleloop tells the model each step's count: docs/models-and-data.md, 'Padding')."""
    ids, mask = _tokens(240, 0)
    parts = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return (DictTensorDataset({k: v[:192] for k, v in parts.items()}),
            DictTensorDataset({k: v[192:] for k, v in parts.items()}))


def lm_pairs_padded() -> tuple[TensorDataset, TensorDataset]:
    """lm_data_padded as ``(input_ids, next tokens)`` pairs: the model is called with the input
    alone (GPT-2's forward names no ``targets``), returns logits, and scaleloop computes the loss;
    a position whose next token is padding, or that has none, has target -100."""
    ids, mask = _tokens(240, 0)
    following = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    real = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)
    targets = following.masked_fill(real == 0, -100)
    return TensorDataset(ids[:192], targets[:192]), TensorDataset(ids[192:], targets[192:])


def lm_pairs() -> tuple[TensorDataset, TensorDataset]:
    """``(input_ids, next tokens)`` pairs without padding: one input tensor and one target, as a
    pipeline takes them (the model is called with the ids alone; scaleloop computes the loss)."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (240, SEQ + 1), generator=g)
    ids[:, 1::2] = (ids[:, :-1:2] + 1) % VOCAB  # every other token follows from the one before
    return TensorDataset(ids[:192, :-1], ids[:192, 1:]), TensorDataset(ids[192:, :-1], ids[192:, 1:])


def classification_data() -> tuple[DictTensorDataset, DictTensorDataset]:
    ids, mask = _tokens(240, 1)
    parts = {"input_ids": ids, "attention_mask": mask, "labels": ids[:, 0] % 3}
    return (DictTensorDataset({k: v[:192] for k, v in parts.items()}),
            DictTensorDataset({k: v[192:] for k, v in parts.items()}))


def resnet_tiny(info: Any = None) -> torch.nn.Module:
    import timm

    # In float64 (with image_data_f64): in fp32 this ResNet's gradients are too ill-conditioned
    # to compare 2 ranks with 1. Its BatchNorms normalise 2x2 and 1x1 maps of 32x32 images, and
    # summing a batch as two halves instead of one already moves its first convolution's
    # gradient by 3e-4 of the largest (1e-3 by step 2), while one process with 1 thread and
    # with 2 threads ends 4e-3 apart at lr 0.1. In float64 the 2 ranks with sync BatchNorm
    # equal 1 process to 1e-14.
    return timm.create_model("resnet10t", pretrained=False, num_classes=10, in_chans=3,
                             zero_init_last=False).double()


def vit_tiny(info: Any = None) -> torch.nn.Module:
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=32, patch_size=8,
                             depth=2, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0)


def image_data() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(160, 3, 32, 32, generator=g)
    y = (x[:, 0].mean((1, 2)) > 0).long() * 5 + (x[:, 1].mean((1, 2)) > 0).long()
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])


def image_data_f64() -> tuple[TensorDataset, TensorDataset]:
    """image_data in float64, for resnet_tiny."""
    train, test = image_data()
    return (TensorDataset(train.tensors[0].double(), train.tensors[1]),
            TensorDataset(test.tensors[0].double(), test.tensors[1]))
