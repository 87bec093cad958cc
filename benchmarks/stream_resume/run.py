"""Resume time of a stream, with and without its state (docs/streaming.md, rule 6).

A stream of 20,000 samples at a small cost each (tests/data/stream_data.py: ``slow_stateful``,
and ``slow_stateless``, the same stream without ``state_dict``) is trained to 10% and to 90% of
its first pass (steps 20 and 180 of 200, a checkpoint there), then resumed. Reported: seconds
from ``train()``'s call to the resumed run's first micro-batch (start-up, checkpoint load, and
the skip or the state load), and the samples the stream yielded before it.

Run: PYTHONPATH=src:tests/data python benchmarks/stream_resume/run.py OUT_DIR
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from scaleloop.config import TrainConfig
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv
from stream_data import StatefulStream

BASE = dict(model="simplenet", epochs=1, batch_size=100, optimizer="adam", lr=0.01, progress=False,
            tensorboard=False, log_every=50, device="cpu", checkpoint_every=0)


class First(Exception):
    """Stops the resumed run at its first micro-batch."""


def resume_time(out: Path, data: str, step: int) -> dict[str, float]:
    cfg = dict(BASE, data=data, out=str(out))
    train(TrainConfig(**cfg, max_steps=step).validate(), DistEnv(), log=lambda _m: None)
    StatefulStream.yielded = 0

    def first(_batch: object) -> None:
        raise First

    started = time.perf_counter()
    try:
        train(TrainConfig(**cfg).validate(), DistEnv(), log=lambda _m: None, on_batch=first)
    except First:
        pass
    return {"seconds": time.perf_counter() - started, "yielded": StatefulStream.yielded}


def main(root: Path) -> None:
    rows = []
    for data in ("stream_data:slow_stateless", "stream_data:slow_stateful"):
        for share, step in (("10%", 20), ("90%", 180)):
            got = resume_time(root / f"{data.split(':')[1]}-{step}", data, step)
            rows.append({"data": data, "at": share, "step": step, **got})
            print(json.dumps(rows[-1]), flush=True)
    (root / "stream-resume.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
