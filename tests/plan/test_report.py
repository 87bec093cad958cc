"""The plan's train line: the model as train's own flags, the data the user brings named as such."""
from __future__ import annotations

from typing import Optional

import pytest

from scaleloop.plan.report import DATA_DIR, data_flags


@pytest.mark.parametrize("data, data_dir, flags, note", [
    (None, None, ["--data", "tokenfile", "--data-dir", DATA_DIR],
     f"{DATA_DIR}: a directory with train.bin and val.bin as nanoGPT's prepare.py writes them"),
    (None, "/data/owt", ["--data", "tokenfile", "--data-dir", "/data/owt"], None),
    ("tokenfile-seq", None, ["--data", "tokenfile-seq", "--data-dir", DATA_DIR], f"{DATA_DIR}: a directory"),
    ("tokens", None, ["--data", "tokens"], "--data tokens is random token ids, a test of speed with nothing to learn"),
    ("mydata:tokens", None, ["--data", "mydata:tokens"], None),
])
def test_a_language_models_data_is_the_users_unless_named(data: Optional[str], data_dir: Optional[str],
                                                           flags: list[str], note: Optional[str]) -> None:
    got, notes = data_flags(data, data_dir, "lm")
    assert got == flags
    assert (notes[0].startswith(note) if note else notes == []), notes


def test_a_classifiers_data_is_a_factory_to_fill_in() -> None:
    flags, [note] = data_flags(None, None, "classification")
    assert flags == ["--data", "YOUR_DATA"] and "YOUR_DATA is your data factory" in note and "class labels" in note
    flags, [note] = data_flags("tokens", None, "classification")
    assert flags == ["--data", "tokens"] and "--data tokens is next-token data" in note
