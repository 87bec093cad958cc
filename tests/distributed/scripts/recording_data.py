"""A user dataset (``--data recording_data:build``) that records which samples each worker loads.

Every ``__getitem__`` of the training set appends the index to
``$RECORD_DIR/rank<R>-restart<K>.txt`` (K: torchrun's restart count), and ``pid-rank<R>-restart<K>``
holds the worker's process id, so a test can kill one worker and later check, attempt by
attempt, exactly which samples were trained on. A short sleep per sample keeps the run long
enough to be interrupted.

``RECORD_HOLD=W:K``: a worker of a group of world size W waits before loading more than K
samples, until its group is stopped (a machine joins) or ``$RECORD_DIR/release`` appears: a
test then knows the run is still going when it acts, on any machine's speed. While it waits,
``$RECORD_DIR/holding`` is there: a test acts once every machine's worker waits.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from scaleloop.data.info import DataInfo, Datasets

N_TRAIN = 1000
DIM = 20


class Recording(Dataset):
    def __init__(self, n: int, seed: int, record_to: Path | None) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = (self.x[:, :3].sum(1) > 0).long()
        self.delay = float(os.environ.get("RECORD_DELAY", "0.002"))
        self.log = open(record_to, "a") if record_to is not None else None
        world, _, after = os.environ.get("RECORD_HOLD", "").partition(":")
        held = record_to is not None and world and int(world) == int(os.environ.get("WORLD_SIZE", "1"))
        self.hold_after = int(after) if held else None
        self.release = record_to.parent / "release" if record_to is not None else None
        self.loaded = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if self.hold_after is not None and self.loaded >= self.hold_after:
            deadline = time.monotonic() + 600   # a bound for a test that failed without stopping it
            holding = self.release.with_name("holding")
            holding.touch()
            while not self.release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            holding.unlink(missing_ok=True)
            self.hold_after = None
        self.loaded += 1
        if self.log is not None:
            self.log.write(f"{i}\n")
            self.log.flush()
            time.sleep(self.delay)
        return self.x[i], self.y[i]


def build() -> Datasets:
    out = Path(os.environ["RECORD_DIR"])
    tag = f"rank{os.environ.get('RANK', '0')}-restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    (out / f"pid-{tag}").write_text(str(os.getpid()))
    train = Recording(N_TRAIN, seed=0, record_to=out / f"{tag}.txt")
    test = Recording(200, seed=1, record_to=None)
    # Given explicitly, so that nothing reads the training set before training does.
    return Datasets(train, test, DataInfo("recording", "classification", (DIM,), 2))
