"""Streams (``IterableDataset``): the splitting rule of ``scaleloop.data.streaming``, the loader
with DataLoader workers, resuming a pass, and training and evaluating on a stream in one process.

The 2-process runs (every sample once over 2 ranks x 2 workers, 2 processes equal 1, a resumed
run equals an uninterrupted one) are tests/distributed/test_streaming_dist.py.
"""
from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset

from scaleloop.config import TrainConfig
from scaleloop.data.sampler import StepSampler
from scaleloop.data.streaming import StreamingLoader, StreamSampler
from scaleloop.errors import UsageError
from scaleloop.loop.training import train
from scaleloop.loop.text import describe_epoch
from scaleloop.runtime.dist import DistEnv
from stream_data import N_TRAIN, SizedStream, Stream, sample_id


def read_all(sampler: StreamSampler, stream, start_step: int = 0, worker: int = 0, workers: int = 1):
    """``sampler.read``'s micro-batches as a list, and the length it returns."""
    out, gen = [], sampler.read(stream, start_step, worker, workers)
    while True:
        try:
            out.append(next(gen))
        except StopIteration as end:
            return out, end.value


def micro_batches(n: int, batch: int, world: int, accumulate: int, workers: int, drop_last: bool = False):
    """Every (rank, worker)'s micro-batches of one pass over the stream ``0, 1, ..., n-1``."""
    got = {}
    for rank, worker in itertools.product(range(world), range(workers)):
        sampler = StreamSampler(batch, world_size=world, rank=rank, accumulate=accumulate, drop_last=drop_last)
        got[rank, worker], length = read_all(sampler, range(n), 0, worker, workers)
        assert length == n
    return got


SIZES = [1, 5, 11, 12, 13, 23, 35, 36, 37, 100]


@pytest.mark.parametrize("world, accumulate, workers", [(1, 1, 1), (1, 2, 3), (2, 1, 2), (2, 2, 2), (3, 1, 1),
                                                        (3, 2, 3), (2, 3, 1), (4, 1, 3)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_is_used_once_per_pass_over_ranks_and_workers(world: int, accumulate: int, workers: int,
                                                                   drop_last: bool) -> None:
    batch = 12 if 12 % (world * accumulate) == 0 else 24
    for n in SIZES:
        got = micro_batches(n, batch, world, accumulate, workers, drop_last)
        # The same steps, and the same dropped tail, as the map-style sampler (sampler.StepSampler).
        reference = StepSampler(n, batch, world_size=world, accumulate=accumulate, drop_last=drop_last)
        used = n - reference.dropped_per_epoch
        flat = [(p, samples) for items in got.values() for p, samples in items]
        positions = [i for p, _ in flat for i in p.indices.tolist()]
        assert sorted(positions) == list(range(used)), f"n={n}: not every sample exactly once"
        assert all(p.indices.tolist() == samples for p, samples in flat), "a micro-batch's samples are its positions"
        steps = {p.step for p, _ in flat}
        assert steps == set(range(reference.steps_per_epoch))
        for step in steps:
            pieces = [(p, s) for p, s in flat if p.step == step]
            assert len(pieces) == world * accumulate   # every rank has every micro-step, none is empty
            size = min(batch, used - step * batch)
            in_step = sorted(i for p, _ in pieces for i in p.indices.tolist())
            assert in_step == list(range(step * batch, step * batch + size))
            for p, _ in pieces:
                assert p.step_samples == size and p.last_micro == (p.micro == accumulate - 1)
                # Each sample's weight in the update is 1 / size (the rank's loss is averaged over W).
                assert p.loss_scale / len(p.indices) / world == pytest.approx(1 / size)
                assert p.pass_samples == (n if step == reference.steps_per_epoch - 1 else None)
        # A micro-step holds the same samples whatever the world size (rule 2; one process may
        # keep a tail too small for W ranks).
        alone = [(p.step, p.micro, i) for p, _ in read_all(StreamSampler(batch, accumulate=accumulate,
                                                                      drop_last=drop_last), range(n))[0]
                 for i in p.indices.tolist() if i < used]
        assert sorted(alone) == sorted((p.step, p.micro, i) for p, _ in flat for i in p.indices.tolist())


def test_workers_share_a_rank_s_micro_batches_in_turn() -> None:
    got = micro_batches(37, 12, world=2, accumulate=2, workers=3)
    for (rank, worker), items in got.items():
        units = [p.step * 2 + p.micro for p, _ in items]
        assert units == sorted(units) and all(u % 3 == worker for u in units), (rank, worker, units)


def test_the_plan_reports_a_pass_once_its_length_is_known() -> None:
    sampler = StreamSampler(12, world_size=2, accumulate=2)
    assert sampler.steps_per_epoch is None and sampler.dropped_per_epoch == 0
    sampler.n = 27   # 2 full steps and 3 samples: fewer than 4 pieces, dropped
    assert (sampler.steps_per_epoch, sampler.dropped_per_epoch) == (2, 3)
    sampler.n = 28
    assert (sampler.steps_per_epoch, sampler.dropped_per_epoch, len(sampler.step_indices(0, 2))) == (3, 0, 4)


@pytest.mark.parametrize("world, accumulate, workers", [(1, 1, 1), (2, 2, 3), (3, 1, 2)])
def test_a_resumed_pass_continues_with_exactly_the_remaining_micro_batches(world: int, accumulate: int,
                                                                            workers: int) -> None:
    n, batch = 61, 12
    for rank, worker in itertools.product(range(world), range(workers)):
        sampler = StreamSampler(batch, world_size=world, rank=rank, accumulate=accumulate)
        everything = [p for p, _ in read_all(sampler, range(n))[0]]
        for start in range(7):   # from every step of the pass (5 or 6 of them), and from past its end
            resumed, length = read_all(sampler, range(n), start, worker, workers)
            assert length == n
            units = [(p.step, p.micro) for p, _ in resumed]
            # This worker's share of the remaining micro-batches, counted from the resumed step.
            expected = [p for p in everything if p.step >= start and ((p.step - start) * accumulate + p.micro)
                        % workers == worker]
            assert units == [(p.step, p.micro) for p in expected]
            assert all(torch.equal(a.indices, b.indices) and a.loss_scale == b.loss_scale
                       for (a, _), b in zip(resumed, expected))


class Numbers(IterableDataset):
    """``(x, i)`` for i in the epoch's order: x = [i], shuffled from the epoch (``set_epoch``)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> list[int]:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(epoch)).tolist()

    def __iter__(self):
        for i in self.order(self.epoch):
            yield torch.tensor([float(i)]), i


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_gives_each_rank_its_share_in_order_with_dataloader_workers(workers: int) -> None:
    data, batch, world, accumulate = Numbers(45), 8, 2, 2
    seen = Counter()
    for epoch in (0, 1):
        for rank in range(world):
            sampler = StreamSampler(batch, world_size=world, rank=rank, accumulate=accumulate)
            loader = StreamingLoader(data, sampler, torch.device("cpu"), num_workers=workers)
            loader.set_epoch(epoch)
            batches = list(loader)
            assert [(b.step, b.place.micro) for b in batches] == [(s, m) for s in range(6) for m in range(2)]
            order = data.order(epoch)
            for b in batches:
                x, y = b
                # The samples are the stream's at the batch's positions, read in this epoch's order.
                assert y.tolist() == [order[i] for i in b.indices.tolist()] == x[:, 0].long().tolist()
                seen.update((epoch, int(i)) for i in y)
            assert sampler.n == 45 and sampler.steps_per_epoch == 6   # learned at the pass's end
    assert seen == Counter({(epoch, i): 1 for epoch in (0, 1) for i in range(45)})


def test_a_stream_cannot_stay_on_the_device_nor_keep_its_workers() -> None:
    loader = StreamingLoader(Numbers(4), StreamSampler(2), torch.device("cpu"), num_workers=1)
    with pytest.raises(ValueError, match="in-memory tensors"):
        loader.configure(on_device=True)
    with pytest.raises(ValueError, match="start again every pass"):
        loader.configure(persistent_workers=True)


@pytest.mark.parametrize("declared, said", [(200, "200"), (250, "250")])
def test_a_pass_that_differs_from_the_stream_s_len_stops_the_run(declared: int, said: str) -> None:
    data = SizedStream(declared=declared)
    loader = StreamingLoader(data, StreamSampler(16, n=declared), torch.device("cpu"))
    with pytest.raises(UsageError, match=f"held 203 samples in epoch 1, but its __len__ says {said}"):
        for _ in loader:
            pass


# --- training and evaluating on a stream, one process --------------------------------------
BASE = dict(data="stream_data:build", model="simplenet", epochs=2, batch_size=16, optimizer="adam", lr=0.01,
            progress=False, tensorboard=False, log_every=1, device="cpu")


def run(tmp_path: Path, name: str, **changes):
    cfg = TrainConfig(**{**BASE, **changes, "out": str(tmp_path / name)}).validate()
    return train(cfg, DistEnv(), log=lambda _msg: None)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


def test_a_stream_trains_every_sample_once_per_epoch_and_reports_its_length(tmp_path: Path) -> None:
    seen: list[tuple[int, list[int], list[int]]] = []
    cfg = TrainConfig(**{**BASE, "out": str(tmp_path / "run"), "accumulate": 2, "checkpoint_every": 13}).validate()
    result = train(cfg, DistEnv(), log=lambda _msg: None,
                   on_batch=lambda b: seen.append((b.step, b.indices.tolist(), sample_id(b[0]["x"]).tolist())))
    assert result.steps == 26 and result.samples == 2 * N_TRAIN
    for epoch in (0, 1):
        ids = [i for _, _, got in seen[epoch * 26:(epoch + 1) * 26] for i in got]
        assert sorted(ids) == list(range(N_TRAIN))
        # Each sample is the one at its position in this epoch's order (set_epoch was called).
        order = Stream().order(epoch).tolist()
        positions = [i for _, got, _ in seen[epoch * 26:(epoch + 1) * 26] for i in got]
        assert ids == [order[i] for i in positions]
    assert describe_epoch(result) == ("a stream of 203 samples in 13 steps, each once, no padding "
                                      "(last step 11, split evenly over workers)")
    assert result.test is not None and result.test.samples == 61
    # The last step of a pass is known as such: its checkpoint is the epoch's end, not step 13 of epoch 1.
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-00000013" / "manifest.json").read_text())
    assert (meta["epoch"], meta["step_in_epoch"]) == (1, 0)


def test_a_run_resumed_mid_pass_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    whole = run(tmp_path, "whole", num_workers=2)
    run(tmp_path, "cut", num_workers=2, max_steps=17, checkpoint_every=5)   # stops at step 4 of epoch 2
    resumed = run(tmp_path, "cut", num_workers=2)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step-00000017"
    a, b = weights(whole.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a), "a resumed stream differs from the uninterrupted run"


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_stateful_stream_resumes_from_its_state_without_reading_the_pass_again(tmp_path: Path,
                                                                                accumulate: int) -> None:
    from stream_data import StatefulStream

    stateful = dict(data="stream_data:stateful", epochs=1, accumulate=accumulate)
    whole = run(tmp_path, "whole", **stateful)
    # Stop at step 12 of the pass's 13 (90%), with a checkpoint there; then resume.
    run(tmp_path, "cut", max_steps=12, **stateful)
    state = torch.load(tmp_path / "cut" / "checkpoints" / "step-00000012" / "state.pt", weights_only=True)
    assert state["data"] == [{"epoch": 0, "step": 12, "state": {"epoch": 0, "position": 12 * 16}}]
    StatefulStream.yielded = 0
    resumed = run(tmp_path, "cut", **stateful)
    assert resumed.resumed_from is not None and resumed.resumed_from.name == "step-00000012"
    # Only the pass's last step's samples were read: none of the 192 the checkpoint had trained on.
    assert StatefulStream.yielded == N_TRAIN - 12 * 16
    a, b = weights(whole.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a), "a stateful stream resumed differs from the uninterrupted run"


def test_a_stateful_stream_resumed_into_a_later_epoch_starts_that_pass_from_its_start(tmp_path: Path) -> None:
    from stream_data import StatefulStream

    whole = run(tmp_path, "whole", data="stream_data:stateful", epochs=3)
    run(tmp_path, "cut", data="stream_data:stateful", epochs=3, max_steps=17, checkpoint_every=5)  # epoch 2, step 4
    StatefulStream.yielded = 0
    resumed = run(tmp_path, "cut", data="stream_data:stateful", epochs=3)
    assert StatefulStream.yielded == 2 * N_TRAIN - 4 * 16   # the rest of epoch 2, then all of epoch 3
    a, b = weights(whole.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stream_whose_state_a_checkpoint_cannot_keep_is_read_again_on_resume(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from stream_data import StatefulStream

    # A state holding an object weights-only loading refuses: warned once, and not saved.
    monkeypatch.setattr(StatefulStream, "state_dict", lambda self: {"position": self.position, "odd": Path("x")})
    said: list[str] = []
    cfg = TrainConfig(**{**BASE, "data": "stream_data:stateful", "epochs": 1, "max_steps": 7, "checkpoint_every": 3,
                         "out": str(tmp_path / "cut")}).validate()
    train(cfg, DistEnv(), log=said.append)
    assert sum("cannot keep" in line for line in said) == 1, said
    state = torch.load(tmp_path / "cut" / "checkpoints" / "step-00000007" / "state.pt", weights_only=True)
    assert "data" not in state
    StatefulStream.yielded = 0
    run(tmp_path, "cut", data="stream_data:stateful", epochs=1)
    assert StatefulStream.yielded == N_TRAIN   # re-read from the pass's start, as a stateless stream is


def test_a_stream_with_a_len_gives_the_schedule_its_length(tmp_path: Path) -> None:
    result = run(tmp_path, "sized", data="stream_data:sized", lr_schedule="cosine", epochs=1)
    assert result.lr.endswith("cosine schedule over 13 steps, down to 0"), result.lr


def test_settings_a_stream_cannot_run_with_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="a stream's length is unknown until a pass ends: add --max-steps N"):
        run(tmp_path, "cosine", lr_schedule="cosine")
    with pytest.raises(UsageError, match=r"model 'simplenet' is sized by the number of classes, which dataset "
                                         r"'stream_data:pairs' does not say.*'num_classes' attribute.*scaleloop.DataInfo"):
        run(tmp_path, "classes", data="stream_data:pairs")
    # A float target of 0/1 is binary from its first sample; --task regression says otherwise.
    assert run(tmp_path, "binary", data="stream_data:floats", epochs=1).steps == 13
    assert run(tmp_path, "regression", data="stream_data:floats", task="regression", epochs=1).steps == 13


def test_evaluating_a_stream_equals_evaluating_the_same_samples_in_memory() -> None:
    from torch.utils.data import TensorDataset

    from scaleloop.data.info import DataInfo
    from scaleloop.loop.evaluation import evaluate
    from scaleloop.models import build_model
    import scaleloop

    info = DataInfo("stream", "classification", (8,), 2)
    torch.manual_seed(0)
    model = build_model("simplenet", info, hidden_dim=16)
    strategy = scaleloop.strategy("single", DistEnv())
    stream = Stream(61, seed=1, shuffle=False, dicts=False)
    streamed = evaluate(model, stream, info, strategy, batch_size=16)
    in_memory = evaluate(model, TensorDataset(stream.x, stream.y), info, strategy, batch_size=16)
    assert streamed.samples == in_memory.samples == 61
    assert streamed.loss == pytest.approx(in_memory.loss, rel=1e-12) and streamed.accuracy == in_memory.accuracy


def test_stream_worker_processes_refuse_a_temporary_directory_too_long_for_their_sockets(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A stream's DataLoader workers hand batches over as a map dataset's do (data.loader.check_worker_socket_dir).
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / ("t" * 80)))
    with pytest.raises(UsageError, match="set TMPDIR to a shorter path, or use --num-workers 0"):
        StreamingLoader(Numbers(4), StreamSampler(2), torch.device("cpu"), num_workers=1)
    StreamingLoader(Numbers(4), StreamSampler(2), torch.device("cpu"))   # no worker processes: nothing to refuse
