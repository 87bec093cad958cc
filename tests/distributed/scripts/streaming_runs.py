"""Under torchrun with 2 processes: short ``scaleloop.train`` runs on a stream (tests/data/stream_data.py)
with 2 DataLoader workers per rank. One launch for all of them.

Usage: streaming_runs.py ROOT. Each run writes ROOT/<name>, and every rank ROOT/<name>/seen-rank<R>.json:
for each micro-batch it trained on, in order, ``[step, micro, positions in the stream, sample ids]``.
``cut`` stops at step 17 (step 4 of epoch 2) with checkpoints; ``cut`` again resumes it (``seen-resumed``).
Rank 0 prints one JSON line: ``{name: [test loss, test samples]}``.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data"))  # tests/data: stream_data

import scaleloop as sl  # noqa: E402
from scaleloop.config import TrainConfig  # noqa: E402
from scaleloop.loop.training import train  # noqa: E402
from stream_data import sample_id  # noqa: E402

# The settings of BASE in test_streaming_dist.py (for the 1-process reference).
BASE = dict(data="stream_data:build", model="simplenet", epochs=2, batch_size=16, accumulate=2, num_workers=2,
            optimizer="adam", lr=0.01, progress=False, tensorboard=False, log_every=1, device="cpu",
            strategy="ddp", nproc=2)
RUNS = [("whole", "seen", {}), ("cut", "seen", {"max_steps": 17, "checkpoint_every": 5}),
        ("cut", "seen-resumed", {})]

root = Path(sys.argv[1])
env = sl.DistEnv.from_env(device="cpu")
sl.init_process_group(env)
tests = {}
for name, record, changes in RUNS:
    seen = []
    cfg = TrainConfig(**{**BASE, **changes, "out": str(root / name)}).validate()
    result = train(cfg, env, log=lambda _msg: None,
                   on_batch=lambda b: seen.append([b.step, b.place.micro, b.indices.tolist(),
                                                   sample_id(b[0]["x"]).tolist()]))
    (root / name / f"{record}-rank{env.rank}.json").write_text(json.dumps(seen))
    tests[f"{name}/{record}"] = [result.test.loss, result.test.samples]
sl.destroy_process_group()
if env.is_main:
    print(json.dumps(tests))
