"""Converting BatchNorm layers for --sync-batchnorm keeps each layer's state, device and dtype."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from scaleloop.strategies.syncbn import GlobalBatchNorm, convert_batchnorm, has_batchnorm


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_conversion_keeps_dtype_and_state(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).to(dtype)
    model.train()
    model(torch.randn(8, 3, 6, 6, dtype=dtype))   # running statistics away from their start
    before = {k: v.clone() for k, v in model[1].state_dict().items()}
    converted = convert_batchnorm(model, torch.device("cpu"))
    bn = converted[1]
    assert isinstance(bn, GlobalBatchNorm) and not has_batchnorm(converted)
    for key, value in bn.state_dict().items():
        assert value.dtype == before[key].dtype, key
        assert torch.equal(value, before[key]), key
    converted.eval()   # outside a process group it is plain BatchNorm, in the model's dtype
    assert converted(torch.randn(2, 3, 6, 6, dtype=dtype)).dtype == dtype
