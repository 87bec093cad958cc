"""``import scaleloop as sl``: ``dir(sl)``, tab completion and ``from scaleloop import *`` show the
whole public API, although the names are exported lazily (``scaleloop.__getattr__``)."""
from __future__ import annotations

import scaleloop


def test_dir_lists_every_exported_name() -> None:
    listed = dir(scaleloop)
    assert set(scaleloop.__all__) <= set(listed)
    assert {"TrainConfig", "train", "DistEnv", "strategy", "launch", "__version__"} <= set(listed)
    assert listed == sorted(listed)
    # Nothing private or imported for the module's own use (typing's Any, the export table).
    assert not [name for name in listed if name not in scaleloop.__all__ and not name.startswith("__")]


def test_every_name_in_all_resolves() -> None:
    for name in scaleloop.__all__:
        assert getattr(scaleloop, name) is not None, name
    assert len(set(scaleloop.__all__)) == len(scaleloop.__all__)


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from scaleloop import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(scaleloop.__all__)
    assert namespace["TrainConfig"] is scaleloop.TrainConfig
