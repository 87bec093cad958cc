"""scaleloop's collectives over a real Gloo group (2 processes): every dtype a metric may return."""
from __future__ import annotations

import pytest
import torch

import scaleloop as sl
from scaleloop.runtime.collectives import gather_tensor

pytestmark = pytest.mark.distributed

# Gloo's all_gather refuses int16, uint16, uint32 and uint64: they travel widened, and come back as they went.
DTYPES = [torch.bool, torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
          torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64]


def gather_every_dtype() -> dict[str, tuple[str, list]]:
    env = sl.DistEnv.from_env(device="cpu")
    sl.init_process_group(env, timeout_s=60)
    try:
        out = {}
        for dtype in DTYPES:
            big = 2 ** 63 + env.rank if dtype == torch.uint64 else (2 ** 31 + env.rank if dtype == torch.uint32 else None)
            values = [big] if big is not None else [env.rank, 1]
            mine = torch.tensor(values[: env.rank + 1], dtype=dtype) if big is None else torch.tensor(values, dtype=dtype)
            got = gather_tensor(mine, env)
            as_ints = got.view(torch.int64) if dtype == torch.uint64 else got.to(torch.int64)
            out[str(dtype)] = (str(got.dtype), [int(v) for v in as_ints.tolist()])
        return out
    finally:
        sl.destroy_process_group()


def test_gather_tensor_carries_every_dtype_over_gloo() -> None:
    results = sl.launch(gather_every_dtype, 2, all_ranks=True)
    for rank in (0, 1):
        got = results[rank]
        for dtype in DTYPES:
            name = str(dtype)
            assert got[name][0] == name, (rank, got[name])
            if dtype == torch.uint64:     # 2**63 and 2**63 + 1: beyond int64, kept bit for bit
                assert got[name][1] == [-2 ** 63, -2 ** 63 + 1]
            elif dtype == torch.uint32:
                assert got[name][1] == [2 ** 31, 2 ** 31 + 1]
            elif dtype == torch.bool:
                assert got[name][1] == [0, 1, 1]
            else:                          # rank 0 sent [0], rank 1 [1, 1]: ragged rows, in rank order
                assert got[name][1] == [0, 1, 1], (name, got[name])
