"""The hand-written PyTorch loop that scaleloop's loop is measured against.

It is the loop one writes without any library, and the fastest reasonable one: batches are
gathered straight from the in-memory tensors, and the loss is summed on the device and read
once per epoch (no ``.item()`` per step). It trains the same model on the same data in the
same order as ``scaleloop train`` with one process, so both end with the same weights, which
``bench overhead`` checks: the two loops did the same work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from scaleloop.config import TrainConfig


@dataclass(frozen=True)
class RawResult:
    train_s: float          # seconds inside the epoch loops (as RunResult.train_s counts them)
    samples: int
    train_loss: float       # mean loss of the last epoch
    state: dict             # final weights


def raw_train(cfg: TrainConfig, device: torch.device) -> RawResult:
    """Train ``cfg``'s model on ``cfg``'s data with a plain loop; in-memory datasets only."""
    from scaleloop.data.datasets import build_datasets
    from scaleloop.loop import build_optimizer, seed_everything
    from scaleloop.models import build_model
    from scaleloop.tasks import loss_fn

    # The same construction, in the same order, as scaleloop.loop.train: identical initial
    # weights and data. The criterion is scaleloop's, since it only picks the task's loss.
    seed_everything(cfg.seed)
    data = build_datasets(cfg.data, n_samples=cfg.n_samples, input_dim=cfg.input_dim, image_size=cfg.image_size,
                          seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, test_fraction=cfg.test_fraction,
                          seed=cfg.seed)
    model = build_model(cfg.model, data.info, hidden_dim=cfg.hidden_dim).to(device)
    optimizer = build_optimizer(cfg, model.parameters())
    torch.manual_seed(cfg.seed)
    x_all, y_all = data.train.tensors
    n, batch = len(x_all), cfg.batch_size

    model.train()
    train_s, samples = 0.0, 0
    epoch_loss = torch.zeros((), device=device)
    for epoch in range(cfg.epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))
        epoch_loss.zero_()
        start = time.perf_counter()
        for i in range(0, n, batch):
            idx = order[i:i + batch]
            x, y = x_all[idx].to(device), y_all[idx].to(device)
            loss = loss_fn(data.info, model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach() * len(idx)
        train_s += time.perf_counter() - start
        samples += n
    return RawResult(train_s, samples, float(epoch_loss) / n,
                     {k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
