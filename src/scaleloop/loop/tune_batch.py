"""``scaleloop tune-batch``'s search for one ``TrainConfig``: its model, data, optimizer and
precision, built as ``scaleloop train`` builds them, searched by ``loop.tune``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from scaleloop.loop.tune import BatchSearch, accelerator, find_max_batch, sample_from
from scaleloop.runtime.devices import describe_device


@dataclass(frozen=True)
class TuneReport:
    """``tune_batch``'s answer for one ``TrainConfig``."""

    search: BatchSearch
    device: str                 # e.g. "cuda:0 (NVIDIA H100 80GB HBM3)"
    workers: int                # devices the global batch is split over
    accumulate: int
    train_samples: int
    total_bytes: Optional[int]  # the device's memory (CUDA)

    @property
    def batch_size(self) -> int:
        """The largest global ``--batch-size`` whose per-device micro-batch fits."""
        return self.search.global_batch(self.workers, self.accumulate)


def tune_batch(cfg: Any) -> TuneReport:
    """Run the search for a ``TrainConfig``: its model, data, optimizer and precision.

    Model and data are built as ``scaleloop train`` builds them; the search runs on one
    device (local rank 0's), without a process group. Pass the config as it will be launched
    (``nproc`` already set to one process per GPU where ``--strategy auto`` does that).
    """
    from scaleloop.data.batch import keeps_target
    from scaleloop.loop.build import build_data_and_model, build_optimizer
    from scaleloop.loop.tasks import resolve_loss

    device = accelerator(cfg.device)
    data, model = build_data_and_model(cfg)
    info = data.info
    # nn.DataParallel splits one process's batch over every GPU; otherwise one device per process.
    workers = torch.cuda.device_count() if cfg.strategy == "dp" and device.type == "cuda" else cfg.world_size
    # A per-device micro-batch never holds more than its share of the training set.
    cap = max(1, -(-len(data.train) // (workers * cfg.accumulate)))
    sample = sample_from(data.train, keeps_target(model, data.train))
    search = find_max_batch(lambda: model, sample, device, loss=resolve_loss(cfg.loss, info),
                            optimizer=lambda params: build_optimizer(cfg, params, model=model),
                            precision=cfg.precision, max_batch=cap)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return TuneReport(search=search, device=describe_device(device), workers=workers,
                      accumulate=cfg.accumulate, train_samples=len(data.train), total_bytes=total)
