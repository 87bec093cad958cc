"""The global-batch rule without torch: the global batch over ranks."""
from __future__ import annotations

import pytest

from scaleloop.data.batching import check_batch_split
from scaleloop.errors import UsageError


def test_global_batch_split_names_the_sizes_to_use() -> None:
    assert check_batch_split(64, 2, 2) == 16
    with pytest.raises(UsageError, match="such as 60 or 66"):
        check_batch_split(64, 3, 2)
