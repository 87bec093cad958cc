"""``scaleloop plan`` on real transformers configs (issue 52 point 4): built on the meta device from
a local config.json (no download), blocks found as the strategies find them, a layout that fits for
Llama-7B on 8 H100s, and a train line that ``scaleloop train`` runs; a model that is not a causal
language model is planned (a factory) or refused in one line (a config), never a traceback."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from scaleloop.cli import build_parser, main
from scaleloop.commands.cmdline import flag_values
from scaleloop.config import resolve
from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import Options, estimate
from scaleloop.plan.planner import plan
from scaleloop.plan.profile import ModelSpec, profile_model
from scaleloop.plan.target import parse_target

transformers = pytest.importorskip("transformers")

#: Llama-7B (Touvron et al. 2023): 32 layers, width 4096, MLP 11008, 32 heads, vocabulary 32,000.
LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16"}
TINY_LLAMA = {**LLAMA_7B, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "max_position_embeddings": 64}
#: GPT-2 small's vocabulary and positions (two narrow layers: the vocabulary is what the test is about).
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
        "n_embd": 64, "n_layer": 2, "n_head": 4}


def write_config(where: Path, values: dict) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(values))
    return where / "config.json"


def train_line(out: str) -> list[str]:
    """The recommended ``scaleloop train`` line of a plan's output, as argv (without ``scaleloop``)."""
    line = next(l for l in out.splitlines() if l.strip().startswith("scaleloop train"))
    return shlex.split(line)[1:]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def llama_7b(tmp_path_factory: pytest.TempPathFactory):
    """Llama-7B's profile at 2048 tokens in bf16, traced once (meta device, fake tensors)."""
    path = write_config(tmp_path_factory.mktemp("llama7b"), LLAMA_7B)
    return profile_model(ModelSpec(model=str(path), seq_len=2048), low_precision=True)


def test_llama_7b_fits_8_h100s_with_plausible_numbers(llama_7b) -> None:
    profile = llama_7b
    assert profile.parameters == 6_738_415_616                    # Llama-7B's published count
    assert len(profile.block_parameters) == 32                    # one block per decoder layer, not one for all
    assert "32 x LlamaDecoderLayer" in profile.summary
    # The pipeline's layers: the embedding, 32 decoder layers (in the stage wrappers that
    # strategies.hf_stages puts around them), the head; the memory model splits activations by blocks.
    assert profile.block_layers.count(True) == 32, profile.block_layers
    options = Options(64, "bf16", "adam")
    fsdp_ac = estimate(profile, Layout("fsdp", fsdp=8, checkpointing=True), options)
    # Model states: 16 bytes a parameter (fp32 parameter, gradient, two Adam moments) over 8 shards.
    states = fsdp_ac.parameters + fsdp_ac.optimizer + 4 * profile.parameters / 8
    assert states == pytest.approx(16 * profile.parameters / 8, rel=1e-6)          # 13.5 GB
    # With checkpointing, 8 samples of 2048 tokens keep each layer's input (2 bytes x 4096 a token),
    # one layer recomputed and the logits' cross-entropy: about 1.5 GB a sample, not 4.7 (the KV cache
    # of a config left with use_cache=True was kept by the checkpoints and grew in the recompute).
    assert fsdp_ac.activations < 8 * 2.0e9
    out = plan(profile.spec, parse_target("h100", 8, 1), options, profile=profile)
    assert "nothing fits" not in out
    recommended = next(l for l in out.splitlines() if l.startswith("recommended:"))
    per_gpu = float(recommended.split(", ")[-1].split()[0])
    assert per_gpu <= 72.0
    argv = train_line(out)
    assert flag(argv, "--model") == profile.spec.model and flag(argv, "--vocab-size") == "32000"
    assert resolve({}, flag_values(build_parser().parse_args(argv))).validate().nproc == 8


def test_gpt2_plans_with_its_vocabulary_and_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path / "gpt2", GPT2)
    assert main(["plan", "--model", str(path.parent), "--gpus", "2", "--gpu", "h100", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "2 x GPT2Block" in out.splitlines()[0]
    argv = train_line(out)
    assert flag(argv, "--vocab-size") == "50257" and flag(argv, "--model") == str(path.parent)


def test_the_printed_train_line_trains_a_config_for_two_steps(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The plan's own line, run on this CPU: random weights from the config, the config's vocabulary,
    on token files of the user's (the line's YOUR_DATA_DIR, filled in)."""
    path = write_config(tmp_path / "tiny", TINY_LLAMA)
    assert main(["plan", "--model", str(path), "--gpus", "1", "--gpu", "h100", "--seq-len", "16",
                 "--batch-size", "4"]) == 0
    argv = train_line(capsys.readouterr().out)
    assert flag(argv, "--model") == str(path) and flag(argv, "--data-dir") == "YOUR_DATA_DIR"
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name, tokens in (("train.bin", 2048), ("val.bin", 512)):
        rng.integers(0, TINY_LLAMA["vocab_size"], tokens, dtype=np.uint16).tofile(data / name)
    argv[argv.index("--data-dir") + 1] = str(data)
    argv[argv.index("--precision") + 1] = "fp32"
    code = main([*argv, "--device", "cpu", "--max-steps", "2", "--out", str(tmp_path / "run"), "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err
    assert (tmp_path / "run").is_dir()


@pytest.mark.parametrize("extra, says", [
    (["--data", "random"], "causal language model needs token data"),
    (["--vocab-size", "1000"], "vocabulary of 128"),
    (["--seq-len", "100"], "max_position_embeddings 64"),
])
def test_train_refuses_a_config_it_cannot_train_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             extra: list[str], says: str) -> None:
    path = write_config(tmp_path / "tiny", TINY_LLAMA)
    argv = ["train", "--model", str(path.parent), "--data", "tokens", "--max-steps", "1", "--n-samples", "64",
            "--device", "cpu", "--out", str(tmp_path / "never"), "--no-progress", *extra]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert "Traceback" not in out + err


def bert_classifier_dir(where: Path) -> Path:
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                     architectures=["BertForSequenceClassification"])
    config.save_pretrained(where)
    return where


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_classifier_config_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    command: str) -> None:
    where = bert_classifier_dir(tmp_path / "bert")
    flags = (["--gpus", "2", "--gpu", "h100", "--seq-len", "32"] if command == "plan" else
             ["--data", "tokens", "--device", "cpu", "--out", str(tmp_path / "never"), "--no-progress"])
    code = main([command, "--model", str(where), *flags])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "BertForSequenceClassification" in err and "not a causal language model" in err
    assert "Traceback" not in out + err


def test_a_classifier_factory_is_planned(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's crash: a factory returning a BERT classifier, whose logits are (batch, classes)."""
    bert_classifier_dir(tmp_path / "bert")
    (tmp_path / "bert_factory.py").write_text(
        "import transformers\n"
        f"def build(info):\n"
        f"    config = transformers.AutoConfig.from_pretrained({str(tmp_path / 'bert')!r})\n"
        "    return transformers.BertForSequenceClassification(config)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "bert_factory", raising=False)
    code = main(["plan", "--model", "bert_factory:build", "--gpus", "2", "--gpu", "h100", "--seq-len", "32"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 x BertLayer" in out.splitlines()[0] and "classifier" in out.splitlines()[0]
    assert "recommended:" in out and "note: the model classifies" in out


def test_a_factory_whose_forward_fails_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_factory.py").write_text(
        "import torch\n"
        "class Broken(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(3, 3)\n"
        "    def forward(self, x):\n"
        "        return self.layer(x)\n"          # token ids (batch, seq) into a Linear: shapes fail
        "def build(info):\n"
        "    return Broken()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_factory", raising=False)
    code = main(["plan", "--model", "broken_factory:build", "--gpus", "2", "--gpu", "h100", "--seq-len", "32"])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.splitlines()) == 1 and "broken_factory:build" in err, err
    assert "Traceback" not in out + err
