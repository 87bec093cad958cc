"""BatchNorm whose statistics cover the global batch (all ranks), on any device.

``torch.nn.SyncBatchNorm`` only runs on GPUs. On CPU (Gloo) this module does the same job:
the per-channel mean and variance are computed from sums that are all-reduced over ranks,
through a differentiable all-reduce so that the backward pass also sees every rank's
contribution. N ranks then normalise exactly as one process with the whole batch would.
"""
from __future__ import annotations

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over all ranks' samples; falls back to plain BatchNorm outside training or alone."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        distributed = torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1
        if not (self.training and distributed):
            return super().forward(x)
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        # Statistics in at least fp32 (a bf16 sum or count would round); the output keeps the
        # input's dtype, as BatchNorm does with low-precision input and fp32 parameters.
        out_dtype = x.dtype
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        # Two passes, like single-process BatchNorm: the mean first, then the squared deviations
        # from that global mean (E[x^2] - E[x]^2 would lose precision).
        sums = differentiable_all_reduce(torch.cat([x.sum(dims), count]))
        n = sums[-1]
        mean = sums[:-1] / n
        centred = x - mean.view(shape)
        var = differentiable_all_reduce((centred * centred).sum(dims)) / n
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
                unbiased = var.detach() * n / max(float(n) - 1, 1.0)
                self.running_var.mul_(1 - m).add_(unbiased, alpha=m)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(out_dtype)


def convert_batchnorm(module: nn.Module, device: torch.device) -> nn.Module:
    """Replace every BatchNorm with a synchronised one: torch's on CUDA, ``GlobalBatchNorm`` elsewhere."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert(module)


def _convert(module: nn.Module) -> nn.Module:
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlobalBatchNorm):
        # The old layer's device and dtype (a float64 or bf16 model keeps its BatchNorm's dtype).
        like = next(module.parameters(), next(module.buffers(), torch.empty(0)))
        new = GlobalBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                              module.track_running_stats, device=like.device,
                              dtype=like.dtype if like.is_floating_point() else None)
        if module.affine:
            with torch.no_grad():
                new.weight.copy_(module.weight)
                new.bias.copy_(module.bias)
        if module.track_running_stats:
            new.running_mean.copy_(module.running_mean)
            new.running_var.copy_(module.running_var)
            new.num_batches_tracked.copy_(module.num_batches_tracked)
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert(child))
    return module


def has_batchnorm(module: nn.Module) -> bool:
    """True if any submodule is an (unsynchronised) BatchNorm layer."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, (GlobalBatchNorm, nn.SyncBatchNorm))
               for m in module.modules())
