"""``scaleloop.destroy_process_group`` over a real Gloo group (2 processes): no DDP wrapper, alive or
already garbage, keeps its Reducer past the group's end (torch 2.13's Reducer destructor can hang
when it frees a group that is gone; scaleloop.runtime.dist says why)."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import scaleloop as sl

pytestmark = pytest.mark.distributed


def keeps_a_reducer(wrapper: DistributedDataParallel) -> bool:
    return "reducer" in wrapper.__dict__ or "logger" in wrapper.__dict__


def wrappers_after_the_group_ends() -> dict[str, bool]:
    env = sl.DistEnv.from_env(device="cpu")
    sl.init_process_group(env, timeout_s=60)
    gc.disable()   # the garbage wrapper must still be garbage, not yet freed, when the group ends
    try:
        alive = DistributedDataParallel(torch.nn.Linear(2, 2))
        garbage = DistributedDataParallel(torch.nn.Linear(2, 2))
        garbage.cycle = [garbage]   # only the collector can free it
        gone = weakref.ref(garbage)
        del garbage
        sl.destroy_process_group()
        left = gone()
        return {"alive keeps a reducer": keeps_a_reducer(alive),
                # Either freed (then its Reducer went while the group was there) or without one.
                "garbage keeps a reducer": left is not None and keeps_a_reducer(left),
                "alive module still works": bool(torch.isfinite(alive.module(torch.ones(1, 2))).all())}
    finally:
        gc.enable()


def test_no_wrapper_keeps_its_reducer_once_the_group_has_ended() -> None:
    results = sl.launch(wrappers_after_the_group_ends, 2, all_ranks=True)
    for rank in (0, 1):
        assert results[rank] == {"alive keeps a reducer": False, "garbage keeps a reducer": False,
                                 "alive module still works": True}, (rank, results[rank])
