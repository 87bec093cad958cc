"""Speed options that change how a model runs, not what it computes: ``--channels-last`` and
the checks before ``--compile`` (which ``loop.train`` applies, in place, once the strategy has
wrapped the model). The data-path options live in ``data/loader.py``, ``--fused-optimizer`` in
``loop.build_optimizer``.
"""
from __future__ import annotations

import torch

from scaleloop.config import TrainConfig
from scaleloop.errors import UsageError


def speed_up_model(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> list[str]:
    """Apply ``--channels-last`` to ``model`` (in place) and check that ``--compile`` can work
    here; returns the notes a run prints. ``--compile`` itself is applied after the strategy
    has wrapped the model (so that DDP's compiled graph knows its gradient buckets)."""
    notes = []
    if cfg.channels_last:
        if any(p.dim() == 4 for p in model.parameters()):
            model.to(memory_format=torch.channels_last)
        else:
            notes.append(f"note: --channels-last changes nothing for {cfg.model}: it has no 4-d (convolution) "
                         "weights")
    if cfg.compile:
        check_compile(device)
        notes.append("note: --compile: the first steps (and the first evaluation) are slow while "
                     "torch.compile compiles the model")
    return notes


def check_compile(device: torch.device) -> None:
    """UsageError, in one line, when torch.compile's default backend (inductor) cannot generate
    code for ``device`` here: C++ on the CPU, Triton on CUDA."""
    import importlib.util
    import os
    import shutil

    if device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise UsageError("--compile on the CPU needs a C++ compiler (g++ or clang++ on the PATH) and none was "
                         "found: install one, or drop --compile")
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise UsageError("--compile on CUDA needs Triton (pip install triton) and it is not installed: install "
                         "it, or drop --compile")
    # Triton builds its kernel launcher with the system's C compiler ($CC, else cc/gcc/clang).
    compilers = [c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c]
    if device.type == "cuda" and not any(shutil.which(c) for c in compilers):
        raise UsageError("--compile on CUDA needs a C compiler for Triton's launcher (gcc or clang on the PATH, "
                         "or $CC) and none was found: install one, or drop --compile")
