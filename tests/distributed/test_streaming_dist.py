"""A stream (``IterableDataset``) on 2 real Gloo processes, each with 2 DataLoader workers (issue 16):

- every sample is trained on exactly once per pass over the 2 ranks, and is the stream's sample
  at its position in that epoch's order; each rank trains on the share the rule gives it;
- 2 processes end with the weights of 1 process on the same stream (1e-5 of the weight scale),
  and evaluate the stream test set to the same loss over the same 61 samples;
- a run stopped by --max-steps in the middle of a pass and resumed from its checkpoint trains
  exactly the rest of that pass, and ends with the uninterrupted run's weights.

The 2-process runs share one torchrun launch (scripts/streaming_runs.py); the 1-process
reference runs in this process. The rule itself: tests/data/test_streaming.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from procs import run
from scaleloop.config import TrainConfig
from scaleloop.data.streaming import StreamSampler
from scaleloop.loop.training import train
from scaleloop.runtime.dist import DistEnv

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPTS = Path(__file__).resolve().parent / "scripts"
DATA = Path(__file__).resolve().parents[1] / "data"   # stream_data.py
sys.path.insert(0, str(DATA))
from stream_data import N_TRAIN, Stream  # noqa: E402

# BASE of scripts/streaming_runs.py, on one process.
BASE = dict(data="stream_data:build", model="simplenet", epochs=2, batch_size=16, accumulate=2, num_workers=2,
            optimizer="adam", lr=0.01, progress=False, tensorboard=False, log_every=1, device="cpu")
STEPS = 13   # per pass: 12 of 16 samples and one of 11


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("streaming")


@pytest.fixture(scope="module")
def two(root: Path) -> dict[str, list[float]]:
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(SCRIPTS / "streaming_runs.py"), str(root / "two")], cwd=root, timeout=240)
    assert res.returncode == 0, f"streaming_runs.py failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return json.loads(res.stdout.strip().splitlines()[-1])


def seen(root: Path, name: str, record: str = "seen") -> dict[int, list]:
    return {rank: json.loads((root / "two" / name / f"{record}-rank{rank}.json").read_text()) for rank in (0, 1)}


def passes(micro_batches: list, first_epoch: int = 0) -> dict[int, list]:
    """A rank's micro-batches by epoch (a new pass starts where the step number goes down)."""
    out: dict[int, list] = {}
    epoch, last = first_epoch, -1
    for mb in micro_batches:
        if mb[0] < last:
            epoch += 1
        last = mb[0]
        out.setdefault(epoch, []).append(mb)
    return out


def test_every_sample_is_trained_on_once_per_pass_over_two_ranks_and_two_workers(two, root: Path) -> None:
    ranks = {rank: passes(mbs) for rank, mbs in seen(root, "whole").items()}
    for epoch in (0, 1):
        order = Stream().order(epoch).tolist()
        positions = [i for rank in (0, 1) for mb in ranks[rank][epoch] for i in mb[2]]
        ids = [i for rank in (0, 1) for mb in ranks[rank][epoch] for i in mb[3]]
        assert sorted(positions) == list(range(N_TRAIN)), f"epoch {epoch}: a position missed or repeated"
        assert sorted(ids) == list(range(N_TRAIN)), f"epoch {epoch}: a sample missed or repeated"
        assert ids == [order[i] for i in positions], f"epoch {epoch}: a sample is not the stream's at its position"
        for rank in (0, 1):
            # In step order, micro-step by micro-step, exactly the share the rule gives this rank.
            sampler = StreamSampler(16, world_size=2, rank=rank, accumulate=2)
            expected = [[p.step, p.micro, p.indices.tolist()] for p, _ in sampler.read(range(N_TRAIN))]
            assert [mb[:3] for mb in ranks[rank][epoch]] == expected


def test_two_processes_equal_one_on_the_same_stream(two, root: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(**{**BASE, "strategy": "single", "out": str(tmp_path / "one")}).validate()
    one = train(cfg, DistEnv(device=torch.device("cpu")), log=lambda _msg: None)
    a, b = weights(one.run_dir), weights(root / "two" / "whole")
    scale = max(t.abs().max().item() for t in a.values())
    diff = max((a[k] - b[k]).abs().max().item() / scale for k in a)
    assert diff <= 1e-5, f"2 processes differ from 1 on a stream: {diff:.2e}"
    loss, samples = two["whole/seen"]
    assert samples == one.test.samples == 61
    assert loss == pytest.approx(one.test.loss, rel=1e-5)


def test_a_run_resumed_mid_pass_trains_the_rest_and_equals_the_uninterrupted_run(two, root: Path) -> None:
    whole = {rank: passes(mbs) for rank, mbs in seen(root, "whole").items()}
    cut = {rank: passes(mbs) for rank, mbs in seen(root, "cut").items()}
    resumed = {rank: passes(mbs, first_epoch=1) for rank, mbs in seen(root, "cut", "seen-resumed").items()}
    for rank in (0, 1):
        # 17 steps: all of epoch 1 and 4 of epoch 2; the resumed run: the 9 others of epoch 2.
        assert cut[rank][0] == whole[rank][0] and cut[rank][1] == whole[rank][1][:4 * 2]
        assert resumed[rank][1] == whole[rank][1][4 * 2:] and set(resumed[rank]) == {1}
    a, b = weights(root / "two" / "whole"), weights(root / "two" / "cut")
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff <= 1e-6, f"the resumed run differs from the uninterrupted one by {diff:.2e}"
    assert two["cut/seen-resumed"] == two["whole/seen"]
