"""``recording_data`` for replica groups (``--data replica_data:build``): each group's workers record
their samples in files of their own, ``group<G>-rank<R>-restart<K>.txt`` (and ``pid-...``).

``REPLICA_HOLD=G:K``: group G's workers wait before loading more than K samples until
``$RECORD_DIR/release`` appears, so that a test knows where the group is when it acts.
"""
from __future__ import annotations

import os
from pathlib import Path

from recording_data import Recording

from scaleloop.data.info import DataInfo, Datasets


def build() -> Datasets:
    out = Path(os.environ["RECORD_DIR"])
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    tag = (f"group{group}-rank{os.environ.get('RANK', '0')}-"
           f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    (out / f"pid-{tag}").write_text(str(os.getpid()))
    train = Recording(1000, seed=0, record_to=out / f"{tag}.txt")
    held, _, after = os.environ.get("REPLICA_HOLD", "").partition(":")
    train.hold_after = int(after) if held == group and tag.endswith("restart0") else None
    test = Recording(200, seed=1, record_to=None)
    return Datasets(train, test, DataInfo("recording", "classification", (20,), 2))
