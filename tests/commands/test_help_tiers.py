"""``--help`` shows the options a newcomer needs first, on one screen; ``--help-all`` every one.

Both exit 0; an unknown flag is still one line with exit code 2. The width is fixed at 80
columns (argparse wraps at the terminal's width) so that the line counts mean one screen.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from scaleloop.cli import main
from scaleloop.commands.verify import VERIFY_COMMON
from scaleloop.config import SETTINGS, common_fields, flag

ROOT = Path(__file__).resolve().parents[2]
SCREEN = 60   # lines: what a newcomer reads before scrolling


@pytest.fixture(autouse=True)
def eighty_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")


def help_text(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def options_in(text: str) -> set[str]:
    """The long flags a help text lists as options (the lines that start with one)."""
    return {m.group(1) for m in re.finditer(r"^  (?:-h, )?(--[a-z][a-z0-9-]*)", text, re.MULTILINE)}


@pytest.mark.parametrize("command", ["train", "tune-batch"])
def test_help_shows_the_common_options_on_one_screen(capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = help_text(capsys, command, "--help")
    shown = options_in(text)
    assert shown == {"--help", "--help-all", "--config", *(flag(name) for name in common_fields())}
    assert len(text.splitlines()) <= SCREEN, text
    hidden = len(SETTINGS) - len(common_fields())
    assert text.splitlines()[-1] == f"{hidden} more options: scaleloop {command} --help-all"


def test_the_common_options_are_the_readme_and_tutorial_ones() -> None:
    # The flags of the README's first command, and those a newcomer goes on to (processes, device).
    assert {"model", "data", "hidden_dim", "epochs", "batch_size", "lr", "optimizer", "nproc", "strategy",
            "device", "out", "precision"} <= set(common_fields())
    assert len(common_fields()) <= 14
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"^scaleloop train (.*)$", readme, re.MULTILINE)
    assert first is not None
    for given in re.findall(r"--[a-z-]+", first.group(1)):
        assert given.removeprefix("--").replace("-", "_") in common_fields(), given


@pytest.mark.parametrize("command", ["train", "tune-batch", "verify"])
def test_help_all_lists_every_option_grouped(capsys: pytest.CaptureFixture[str], command: str) -> None:
    text = help_text(capsys, command, "--help-all")
    for name in SETTINGS:
        assert flag(name) in text, name
    for group in ("model and data:", "training:", "hardware:", "speed:", "launch:", "checkpoints:", "output:"):
        assert f"\n{group}\n" in text, group
    assert len(text.splitlines()) > 3 * SCREEN   # the whole list, not the short one


def test_verify_help_shows_verify_and_the_common_training_options(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_text(capsys, "verify", "--help")
    assert options_in(text) == {"--help", "--help-all", *(flag(name) for name in VERIFY_COMMON)}
    assert len(text.splitlines()) <= SCREEN, text
    assert text.splitlines()[-1].endswith("more options: scaleloop verify --help-all")


@pytest.mark.parametrize("argv, message", [
    (["train", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["train", "--help-al"], "unrecognized arguments: --help-al"),        # no abbreviations, as before
    (["verify", "--mesh-x", "1"], "unrecognized arguments: --mesh-x 1"),
    (["train", "--strategy", "nope"], "argument --strategy: invalid choice: 'nope'"),
])
def test_bad_flags_are_one_line_with_exit_code_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 message: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err, err


def test_a_hidden_option_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    from scaleloop.cli import build_parser

    args = build_parser().parse_args(["train", "--rdzv-id", "job7", "--no-progress"])
    assert args.rdzv_id == "job7" and args.progress is False
