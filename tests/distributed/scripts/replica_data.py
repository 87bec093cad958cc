"""``recording_data`` for replica groups (``--data replica_data:build``): each group's workers record
their samples in files of their own, ``group<G>-rank<R>-restart<K>.txt`` (and ``pid-...``).

``REPLICA_HOLD=G:K``: group G's workers wait before loading more than K samples until
``$RECORD_DIR/release`` appears, so that a test knows where the group is when it acts.
``REPLICA_REJOIN=G``: group G's restarted workers wait before training until ``$RECORD_DIR/rejoin``
appears (the others train without it meanwhile).

``--model replica_data:model`` is SimpleNet; with ``REPLICA_STOP_IN=G:K`` group G's first workers
stop inside the forward of their K-th training step (after the step's quorum, before its gradient
average): they write ``$RECORD_DIR/in-step-K`` and wait there to be killed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from recording_data import Recording

from torch import nn

from scaleloop.data.info import DataInfo, Datasets
from scaleloop.models import build_model


def build() -> Datasets:
    out = Path(os.environ["RECORD_DIR"])
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    tag = (f"group{group}-rank{os.environ.get('RANK', '0')}-"
           f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    (out / f"pid-{tag}").write_text(str(os.getpid()))
    if os.environ.get("REPLICA_REJOIN") == group and not tag.endswith("restart0"):
        deadline = time.monotonic() + 300   # a bound for a test that failed without releasing it
        while not (out / "rejoin").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    train = Recording(1000, seed=0, record_to=out / f"{tag}.txt")
    held, _, after = os.environ.get("REPLICA_HOLD", "").partition(":")
    train.hold_after = int(after) if held == group and tag.endswith("restart0") else None
    test = Recording(200, seed=1, record_to=None)
    return Datasets(train, test, DataInfo("recording", "classification", (20,), 2))


def model(info: DataInfo) -> nn.Module:
    net = build_model("simplenet", info)
    group, _, step = os.environ.get("REPLICA_STOP_IN", "").partition(":")
    if group != os.environ.get("REPLICA_GROUP_ID", "0") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return net
    forwards = 0

    def stop(module: nn.Module, args: Any) -> None:
        nonlocal forwards
        forwards += module.training
        if module.training and forwards == int(step):
            (Path(os.environ["RECORD_DIR"]) / f"in-step-{step}").touch()
            deadline = time.monotonic() + 300   # a bound for a test that failed without killing it
            while time.monotonic() < deadline:
                time.sleep(0.05)

    net.register_forward_pre_hook(stop)
    return net
