"""``scaleloop sample RUN_DIR`` (issue 55 point 2): text from a run that trained TinyGPT on a
character corpus, decoded with the corpus's nanoGPT ``meta.pkl``; seeded; a nanoGPT-style model
returning ``(logits, loss)`` generates too; bad input is one line and exit code 2, and a model.pt
that would run code is refused without running it."""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from torch import nn

import scaleloop
from scaleloop.cli import main
from scaleloop.config import TrainConfig, to_toml
from scaleloop.sampling import generate_ids

TEXT = "hello world, hello tokens\n" * 160   # 30 steps of 8 windows of 16: one epoch
QUIET = ["--device", "cpu", "--no-progress", "--tracker", "none"]


def char_corpus(directory: Path, text: str = TEXT) -> Path:
    """A directory as nanoGPT's shakespeare_char/prepare.py leaves it: train.bin, val.bin, meta.pkl."""
    directory.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[ch] for ch in text], dtype=np.uint16)
    ids[: len(ids) * 9 // 10].tofile(directory / "train.bin")
    ids[len(ids) * 9 // 10:].tofile(directory / "val.bin")
    (directory / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": len(chars), "itos": dict(enumerate(chars)),
                                                       "stoi": stoi}))
    return directory


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices: torch's second thread only waits for the first, and much longer when the
    suite's other worker holds the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def char_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TinyGPT trained 30 steps on the character corpus."""
    root = tmp_path_factory.mktemp("sampling")
    data = char_corpus(root / "data")
    run = root / "run"
    assert main(["train", "--model", "tinygpt", "--data", "tokenfile", "--data-dir", str(data), "--seq-len", "16",
                 "--batch-size", "8", "--max-steps", "30", "--lr", "0.003", "--out", str(run), *QUIET]) == 0
    return run


def test_samples_are_text_over_the_corpus_and_the_seed_fixes_them(char_run: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    argv = ["sample", str(char_run), "--prompt", "hello", "--max-new-tokens", "40", "--seed", "1",
            "--num-samples", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    samples = out.rstrip("\n").split("\n" + "-" * 40 + "\n")
    assert len(samples) == 2, out
    for text in samples:
        assert text.startswith("hello") and len(text) == len("hello") + 40
        assert set(text) <= set(TEXT), text
    # The library gives the same texts for the same seed; another seed draws others.
    again = scaleloop.sample(char_run, "hello", max_new_tokens=40, seed=1, num_samples=2)
    assert again == samples
    assert scaleloop.sample(char_run, "hello", max_new_tokens=40, seed=2, num_samples=2) != samples


def _fake_run(where: Path, model_pt: bytes, **settings: object) -> Path:
    where.mkdir()
    (where / "config.toml").write_text(to_toml(TrainConfig(**settings)))
    (where / "model.pt").write_bytes(model_pt)
    return where


class _Runs:
    """A pickle that calls ``open(marker, "w")`` when loaded as plain pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def test_bad_input_is_one_line_and_exit_code_2(char_run: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    hostile, marker = shutil.copytree(char_run, tmp_path / "hostile", ignore=shutil.ignore_patterns("checkpoints")), \
        tmp_path / "ran"
    (hostile / "model.pt").write_bytes(pickle.dumps({"w": _Runs(marker)}))
    classifier = _fake_run(tmp_path / "mlp", b"", model="simplenet", data="digits")
    cases = [
        ([str(tmp_path / "nope"), "--prompt", "hello"], "no run directory"),
        ([str(classifier), "--prompt", "hello"], "is not a language model run (--model simplenet)"),
        ([str(char_run), "--prompt", "hello?"], "'?' is not in the vocabulary of"),
        ([str(char_run), "--prompt", "hello", "--top-k", "0"], "--top-k must be a positive integer"),
        ([str(hostile), "--prompt", "hello"], "refusing to load"),
    ]
    capsys.readouterr()
    for argv, needle in cases:
        assert main(["sample", *argv]) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and needle in err, (argv, err)
    assert not marker.exists()   # the hostile model.pt ran nothing


class NanoStyle(nn.Module):
    """As nanoGPT's GPT: ``forward(idx, targets=None)`` returns ``(logits, loss)``, and without
    targets the logits of the last position only. Here it always predicts ``(last token + 1) % 5``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(10.0))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        nxt = (idx[:, -1:] + 1) % 5
        logits = self.scale * nn.functional.one_hot(nxt, 5).float()
        return logits, None


def test_a_model_returning_logits_and_loss_generates_with_its_context_cropped() -> None:
    out = generate_ids(NanoStyle(), torch.tensor([[3], [0]]), 6, temperature=0, context=2)
    assert out.tolist() == [[3, 4, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 0, 1]]
    # vocab: ids the codec cannot write are never drawn, even when the model prefers them.
    assert generate_ids(NanoStyle(), torch.tensor([[3]]), 2, temperature=0, vocab=4).tolist()[0][1] != 4


def test_a_local_tokenizer_directory_encodes_and_decodes(char_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``--tokenizer DIR``: a transformers tokenizer saved in a directory (built here, nothing
    downloaded) over the corpus's characters, with the ids meta.pkl gives them, encodes the prompt
    and decodes the samples; the same seed gives the same text."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    chars = sorted(set(TEXT))
    vocab = {ch: i for i, ch in enumerate(chars)}
    model = tokenizers.models.WordLevel(vocab, unk_token="h")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")   # one token per character
    tok.decoder = tokenizers.decoders.Fuse()                                            # joined with no spaces
    directory = tmp_path / "tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)
    argv = ["sample", str(char_run), "--prompt", "hello", "--tokenizer", str(directory), "--max-new-tokens", "20",
            "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hello" in out and set(out) - {"\n", "-"} <= set(chars) | set("0123456789 =:"), out
    assert main(argv) == 0
    assert capsys.readouterr().out == out
    with_meta = scaleloop.sample(char_run, "hello", max_new_tokens=20, seed=3)
    assert with_meta == scaleloop.sample(char_run, "hello", max_new_tokens=20, seed=3, tokenizer=str(directory))
    assert main(["sample", str(char_run), "--prompt", "hi", "--tokenizer", str(tmp_path / "none")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
