"""Start-up stays cheap: heavy optional modules load only where they are used (no timing here;
``scaleloop bench overhead --mode startup`` measures the seconds)."""
from __future__ import annotations

import pytest

from scaleloop.bench.startup import _env, loaded_modules

HEAVY_OPTIONAL = {"matplotlib", "tensorboard", "torch.utils.tensorboard", "sklearn"}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return _env(bytecode_cache=False)   # which modules load does not depend on it


def test_import_scaleloop_loads_neither_torch_nor_optional_modules(env: dict[str, str]) -> None:
    assert loaded_modules(["-c", "import scaleloop"], env) == []


def test_the_whole_library_loads_no_optional_module(env: dict[str, str]) -> None:
    loaded = set(loaded_modules(["-c", "import scaleloop; scaleloop.train; scaleloop.Strategy"], env))
    assert "torch" in loaded
    assert not loaded & HEAVY_OPTIONAL, loaded


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["bench", "overhead", "--help"]])
def test_help_imports_no_torch(env: dict[str, str], argv: list[str]) -> None:
    assert loaded_modules(["-m", "scaleloop", *argv], env) == []
