"""A model factory for ``--model dropout_models:dropout_net``: dropout makes training draw random
numbers, so only a resume that restores the RNG states continues bitwise."""
from __future__ import annotations

import math

from torch import nn


def dropout_net(info) -> nn.Module:
    features = math.prod(info.input_shape)
    outputs = 1 if info.task == "binary" else info.num_classes
    return nn.Sequential(nn.Flatten(1), nn.Linear(features, 32), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(32, outputs))
