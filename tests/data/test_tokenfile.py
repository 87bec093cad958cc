"""Token files (``--data tokenfile`` / ``tokenfile-seq``, scaleloop.data.tokenfile): windows of a
flat uint16/uint32 file written with ``ndarray.tofile``, read through a memory map; the same
windows on 1 and 2 ranks; a run resumed mid-epoch equals the uninterrupted one; bad input is
one line and exit code 2."""
from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from scaleloop.config import TrainConfig
from scaleloop.data.datasets import build_datasets
from scaleloop.data.loader import ShardedLoader
from scaleloop.data.sampler import StepSampler
from scaleloop.data.tokenfile import TokenFileDataset
from scaleloop.errors import UsageError
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv

SRC = Path(__file__).resolve().parents[2] / "src"


def write(directory: Path, train: np.ndarray, val: np.ndarray | None = None, meta: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    train.tofile(directory / "train.bin")
    if val is not None:
        val.tofile(directory / "val.bin")
    if meta is not None:
        (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def phrases(n: int, vocab: int = 50, seed: int = 0) -> np.ndarray:
    """``n`` uint16 tokens of repeated random 6-token phrases (learnable, like text)."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, (16, 6))
    return table[rng.integers(0, 16, n // 6 + 1)].reshape(-1)[:n].astype(np.uint16)


def test_sequential_windows_cover_the_file_in_order_and_y_is_x_shifted(tmp_path: Path) -> None:
    data = build_datasets("tokenfile-seq", data_dir=str(write(tmp_path, np.arange(101, dtype=np.uint16),
                                                               np.arange(50, dtype=np.uint16))),
                          seq_len=10, vocab_size=200)
    train_set = data.train
    assert len(train_set) == 10 and data.info.num_classes == 200 and data.info.task == "lm"
    for i in range(10):
        x, y = train_set[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.tolist() == list(range(10 * i, 10 * i + 10)) and y.tolist() == list(range(10 * i + 1, 10 * i + 11))
    assert len(data.test) == 4 and data.test[3][1].tolist() == list(range(31, 41))
    with pytest.raises(IndexError):
        train_set[10]


def test_random_windows_are_fixed_by_seed_and_index_and_reach_the_whole_file(tmp_path: Path) -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    write(tmp_path, tokens)
    a = build_datasets("tokenfile", data_dir=str(tmp_path), seq_len=16, vocab_size=1000, seed=3).train
    again = build_datasets("tokenfile", data_dir=str(tmp_path), seq_len=16, vocab_size=1000, seed=3).train
    other = build_datasets("tokenfile", data_dir=str(tmp_path), seq_len=16, vocab_size=1000, seed=4).train
    starts = [a.start(i) for i in range(len(a))]
    assert starts == [again.start(i) for i in range(len(a))] and starts != [other.start(i) for i in range(len(a))]
    assert min(starts) >= 0 and max(starts) <= 1000 - 17 and len(set(starts)) > len(a) // 2
    for i in (0, 5, len(a) - 1):
        x, y = a[i]
        assert x.tolist() == tokens[starts[i]:starts[i] + 16].tolist()
        assert torch.equal(x[1:], y[:-1]) and int(y[-1]) == int(x[-1]) + 1
    # The last possible start is reachable: a window may end on the file's last token.
    small = TokenFileDataset(tmp_path / "train.bin", 998, 1000, windows="random")
    assert {small.start(i) for i in range(200)} == {0, 1}


def test_a_batch_read_at_once_holds_the_windows_read_one_by_one(tmp_path: Path) -> None:
    # The DataLoader reads a batch's windows in one gather (__getitems__); each is the window
    # __getitem__ gives, and a token beyond the vocabulary names its own window, not the batch's first.
    write(tmp_path, phrases(2000, vocab=50))
    for windows in ("random", "sequential"):
        data = TokenFileDataset(tmp_path / "train.bin", 12, 50, windows=windows, seed=5)
        picks = [7, 0, len(data) - 1, 7, 40]
        for (x, y), i in zip(data.__getitems__(picks), picks):
            one_x, one_y = data[i]
            assert torch.equal(x, one_x) and torch.equal(y, one_y) and x.dtype == torch.int64
        with pytest.raises(IndexError):
            data.__getitems__([0, len(data)])
    tokens = np.zeros(200, dtype=np.uint16)
    tokens[130] = 99
    write(tmp_path / "bad", tokens)
    bad = TokenFileDataset(tmp_path / "bad" / "train.bin", 10, 50, windows="sequential")
    with pytest.raises(UsageError, match=r"holds token 99 \(window 13, from token 130\)"):
        bad.__getitems__([0, 1, 13, 2])


def test_the_file_is_mapped_not_read_and_a_pickle_carries_no_tokens(tmp_path: Path) -> None:
    write(tmp_path, phrases(200_000))
    ds = build_datasets("tokenfile", data_dir=str(tmp_path), seq_len=32, vocab_size=50).train
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.filename is not None
    clone = pickle.loads(pickle.dumps(ds))   # what a DataLoader worker gets
    assert len(pickle.dumps(ds)) < 2_000 and clone._tokens is None
    assert torch.equal(clone[7][0], ds[7][0]) and isinstance(clone.tokens, np.memmap)


def test_meta_json_gives_the_token_type_and_the_vocabulary(tmp_path: Path) -> None:
    tokens = np.array([70_000, 1, 2, 3, 65_536, 5, 6, 7, 8], dtype=np.uint32)
    data = build_datasets("tokenfile-seq", data_dir=str(write(tmp_path, tokens, meta={"dtype": "uint32",
                                                                                       "vocab_size": 70_001})),
                          seq_len=4, vocab_size=256)
    assert data.info.num_classes == 70_001 and data.train.vocab_size == 70_001 and data.test is None
    assert data.train[0][0].tolist() == [70_000, 1, 2, 3] and data.train[1][0].tolist() == [65_536, 5, 6, 7]


@pytest.mark.parametrize("make, flags, message", [
    (None, {}, "pass --data-dir DIR"),
    ("nothing", {}, "does not exist"),
    ("empty", {}, "holds no train.bin"),
    ("short", {}, r"holds 10 uint16 tokens, fewer than one window of --seq-len 16 needs \(17\)"),
    ("odd", {}, r"is 22 bytes, not a whole number of uint32 tokens"),
    ("baddtype", {}, r"\"dtype\" 'int8' is not a token type"),
    ("beyond", {}, r"holds token 3[0-9][0-9] .*beyond the vocabulary of 256"),
])
def test_bad_token_files_are_one_clear_error(tmp_path: Path, make: str | None, flags: dict, message: str) -> None:
    directory = tmp_path / "d"
    if make == "empty":
        directory.mkdir()
    elif make == "short":
        write(directory, np.arange(10, dtype=np.uint16))
    elif make == "odd":
        write(directory, np.arange(11, dtype=np.uint16), meta={"dtype": "uint32"})
    elif make == "baddtype":
        write(directory, np.arange(100, dtype=np.uint16), meta={"dtype": "int8"})
    elif make == "beyond":
        write(directory, np.arange(290, 400, dtype=np.uint16))
    with pytest.raises(UsageError, match=message):
        build_datasets("tokenfile", data_dir=None if make is None else str(directory), seq_len=16, vocab_size=256)


def test_a_bad_token_file_exits_2_with_one_line(tmp_path: Path) -> None:
    write(tmp_path / "d", np.arange(10, dtype=np.uint16))
    res = subprocess.run([sys.executable, "-m", "scaleloop", "train", "--data", "tokenfile-seq", "--data-dir",
                          str(tmp_path / "d"), "--model", "tinygpt", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and "fewer than one window" in lines[0] and "Traceback" not in res.stderr


@pytest.mark.parametrize("name", ["tokenfile", "tokenfile-seq"])
def test_every_step_holds_the_same_windows_on_1_and_2_ranks(tmp_path: Path, name: str) -> None:
    write(tmp_path, phrases(3000))
    ds = build_datasets(name, data_dir=str(tmp_path), seq_len=16, vocab_size=50, seed=1).train
    shuffle = not ds.in_order

    def steps(world: int) -> dict[int, torch.Tensor]:
        """Each step's windows over all ranks, rank by rank (the sampler cuts a step in rank order)."""
        out: dict[int, list[torch.Tensor]] = {}
        for rank in range(world):
            sampler = StepSampler(len(ds), 24, world_size=world, rank=rank, shuffle=shuffle, seed=1)
            loader = ShardedLoader(ds, sampler, torch.device("cpu"))
            loader.set_epoch(1)
            for batch in loader:
                out.setdefault(batch.step, [None] * world)[rank] = batch[0]
        return {step: torch.cat(parts) for step, parts in out.items()}

    one, two = steps(1), steps(2)
    assert one.keys() == two.keys() and len(one) == -(-len(ds) // 24)
    assert all(torch.equal(one[s], two[s]) for s in one)
    firsts = torch.cat([one[s] for s in sorted(one)])[:, 0].tolist()
    starts = [ds.start(i) for i in range(len(ds))]
    if name == "tokenfile-seq":   # in file order: window i is the i-th sample of the epoch
        assert firsts == [int(ds.tokens[s]) for s in starts]


BASE = dict(model="tinygpt", hidden_dim=32, seq_len=16, batch_size=8, epochs=2, optimizer="adam", lr=0.01,
            progress=False, tensorboard=False, log_every=1, device="cpu")


def run(directory: Path, out: Path, **changes):
    cfg = TrainConfig(**{**BASE, "data_dir": str(directory), "vocab_size": 50, **changes, "out": str(out)}).validate()
    return train(cfg, DistEnv(), log=lambda _msg: None)


@pytest.mark.parametrize("name", ["tokenfile", "tokenfile-seq"])
def test_a_run_resumed_mid_epoch_ends_bitwise_equal_to_the_uninterrupted_run(tmp_path: Path, name: str) -> None:
    directory = write(tmp_path / "data", phrases(1000), phrases(200, seed=1))   # 62 windows: 8 steps an epoch
    seen: list[list[int]] = []
    whole = run(directory, tmp_path / "whole", data=name)
    cut = TrainConfig(**{**BASE, "data": name, "data_dir": str(directory), "vocab_size": 50, "max_steps": 11,
                         "checkpoint_every": 3, "out": str(tmp_path / "cut")}).validate()
    train(cut, DistEnv(), log=lambda _msg: None)   # stops at step 3 of epoch 2
    resumed = train(dataclasses.replace(cut, max_steps=None), DistEnv(), log=lambda _msg: None,
                    on_batch=lambda b: seen.append(b.indices.tolist()))
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step-00000011"
    assert whole.steps == 16 and resumed.test is not None
    if name == "tokenfile-seq":   # the rest of epoch 2, in file order
        assert [i for batch in seen for i in batch] == list(range(3 * 8, 62))
    a = torch.load(whole.run_dir / "model.pt", weights_only=True)
    b = torch.load(resumed.run_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- nanoGPT's meta.pkl, and the vocabulary rule (issue 55) -----------------------------------

def nanogpt_dir(directory: Path, text: str = "hello world, hello tokens\n" * 20) -> Path:
    """A directory as nanoGPT's shakespeare_char/prepare.py leaves it: train.bin, val.bin, meta.pkl."""
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    write(directory, ids[: len(ids) * 9 // 10], ids[len(ids) * 9 // 10:])
    with open(directory / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, fh)
    return directory


def test_meta_pkl_gives_the_vocabulary(tmp_path: Path) -> None:
    data = build_datasets("tokenfile", data_dir=str(nanogpt_dir(tmp_path)), seq_len=8, vocab_size=256)
    assert data.info.num_classes == 14 and data.train.vocab_size == 14
    assert data.notes == [f"note: vocabulary of 14 tokens, as '{tmp_path}/meta.pkl' declares"]


def test_a_larger_vocab_size_is_used_with_a_note_and_a_smaller_one_refused(tmp_path: Path) -> None:
    directory = str(nanogpt_dir(tmp_path))
    data = build_datasets("tokenfile", data_dir=directory, seq_len=8, vocab_size=64)
    assert data.info.num_classes == 64 and len(data.notes) == 1 and "is larger than the 14" in data.notes[0]
    with pytest.raises(UsageError, match=r"--vocab-size 10 is smaller than the vocabulary of 14 .*give at least 14"):
        build_datasets("tokenfile", data_dir=directory, seq_len=8, vocab_size=10)
    assert build_datasets("tokenfile", data_dir=directory, seq_len=8, vocab_size=14).notes == []


def test_meta_json_and_meta_pkl_that_disagree_are_refused(tmp_path: Path) -> None:
    directory = nanogpt_dir(tmp_path)
    (directory / "meta.json").write_text(json.dumps({"vocab_size": 50}))
    with pytest.raises(UsageError, match="declare different vocabularies"):
        build_datasets("tokenfile", data_dir=str(directory), seq_len=8, vocab_size=256)


class _Runs:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.marker, "w"))


def test_a_meta_pkl_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    directory, marker = nanogpt_dir(tmp_path / "data"), tmp_path / "ran"
    with open(directory / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 14, "itos": _Runs(marker)}, fh)
    with pytest.raises(UsageError, match=r"refusing to read .*meta.pkl': it names io.open") as exc:
        build_datasets("tokenfile", data_dir=str(directory), seq_len=8, vocab_size=256)
    assert "\n" not in str(exc.value) and not marker.exists()
    pickle.loads(pickle.dumps(_Runs(marker)))   # the same object, loaded plainly, does run
    assert marker.exists()


def test_the_default_vocab_size_is_the_config_s() -> None:
    from scaleloop.config import TrainConfig
    from scaleloop.data.tokenfile import DEFAULT_VOCAB

    assert TrainConfig().vocab_size == DEFAULT_VOCAB


def test_a_nanogpt_directory_trains_with_its_vocabulary_and_says_so(tmp_path: Path) -> None:
    directory = nanogpt_dir(tmp_path / "data")
    said: list[str] = []
    cfg = TrainConfig(model="tinygpt", data="tokenfile", data_dir=str(directory), seq_len=8, max_steps=2,
                      batch_size=8, progress=False, tensorboard=False, device="cpu", out=str(tmp_path / "run"))
    train(cfg.validate(), DistEnv(), log=said.append)
    assert any("vocabulary of 14 tokens" in line for line in said), said
    assert any("language modelling over 14 tokens" in line for line in said), said
