"""The project reads each setting from its section (``cfg.optim.lr``), never through the flat view
(``cfg.lr``), which stays only for users' scripts written that way (issue 54: each component
reads its own section; one name, one place)."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

from scaleloop.config import TrainConfig
from scaleloop.config.train_config import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
TREES = ("src", "tests", "tools", "benchmarks", "examples")


def _receiver(node: ast.expr) -> str:
    """The last name of an attribute's owner: ``run.cfg`` -> ``cfg``; ``cfg`` -> ``cfg``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def flat_reads(path: Path, root: Path = ROOT) -> Iterator[str]:
    """``file:line cfg.name`` for each read of a setting by its flat name on a config (a name ending
    in ``cfg``: ``cfg``, ``self.cfg``, ``run.cfg``, ``ref_cfg``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in SETTINGS
                and _receiver(node.value).endswith("cfg")):
            yield f"{path.relative_to(root)}:{node.lineno} {_receiver(node.value)}.{node.attr}"


def test_no_setting_is_read_by_its_flat_name() -> None:
    found = [hit for tree in TREES if (ROOT / tree).is_dir()
             for path in sorted((ROOT / tree).rglob("*.py")) for hit in flat_reads(path)]
    assert not found, "read these from their sections (cfg.<section>.<name>):\n" + "\n".join(found)


def test_the_check_finds_a_flat_read(tmp_path: Path) -> None:
    """The check above can fail: a flat read in a file is found, a section's read is not."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f(run):\n    return run.cfg.lr, run.cfg.optim.lr, '''cfg.lr in a string'''\n")
    hits = [hit.split(" ", 1)[1] for hit in flat_reads(sample, tmp_path)]
    assert hits == ["cfg.lr"]


def test_users_scripts_still_read_the_flat_view_and_setting_reads_by_name() -> None:
    cfg = TrainConfig(lr=0.25, nproc=2, clip_grad=1.0)
    assert getattr(cfg, "lr") == cfg.optim.lr == cfg.setting("lr") == 0.25   # the flat view, for users
    assert cfg.setting("nproc") == cfg.launch.nproc == 2
    assert cfg.setting("clip_grad") == cfg.optim.clip_grad == 1.0
    assert cfg.flat()["lr"] == 0.25
