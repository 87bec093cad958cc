"""Tests for scaleloop.config: validation, TOML loading, precedence and the saved config."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from scaleloop.config import (
    GROUPS,
    OPTIMIZERS,
    PRECISIONS,
    SECTIONS,
    SETTINGS,
    STRATEGIES,
    OptimSettings,
    TrainConfig,
    coerce,
    config_for_resume,
    field_types,
    flag,
    load_toml,
    resolve,
    to_toml,
)
from scaleloop.errors import UsageError

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _write(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults and validation ------------------------------------------------------------

def test_defaults_validate() -> None:
    cfg = TrainConfig()
    assert cfg.validate() is cfg
    assert cfg.model_data.model == "simplenet" and cfg.model_data.data == "digits"
    assert cfg.optim.optimizer in OPTIMIZERS and cfg.parallel.precision in PRECISIONS and cfg.parallel.strategy in STRATEGIES


def test_flag_names() -> None:
    assert flag("batch_size") == "--batch-size"
    assert flag("lr") == "--lr"


def test_field_types_unwrap_optional() -> None:
    types = field_types()
    assert types["max_steps"] is int
    assert types["clip_grad"] is float
    assert types["data_dir"] is str
    assert types["progress"] is bool
    assert set(types) == set(SETTINGS)


@pytest.mark.parametrize("name", ["hidden_dim", "n_samples", "input_dim", "image_size", "seq_len",
                                  "vocab_size", "epochs", "batch_size", "accumulate", "log_every",
                                  "max_steps"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes_are_rejected(name: str, value: int) -> None:
    with pytest.raises(UsageError, match=f"{flag(name)} must be a positive integer"):
        TrainConfig(**{name: value}).validate()


@pytest.mark.parametrize("name,value,what", [
    ("lr", 0.0, "a positive number"),
    ("lr", -0.1, "a positive number"),
    ("lr", float("nan"), "a positive number"),
    ("weight_decay", -1e-4, "zero or positive"),
    ("momentum", -0.5, "zero or positive"),
    ("num_workers", -1, "zero or positive"),
    ("clip_grad", 0.0, "a positive number"),
    ("clip_grad", -1.0, "a positive number"),
    ("test_fraction", -0.1, r"in \[0, 1\)"),
    ("test_fraction", 1.0, r"in \[0, 1\)"),
    ("test_fraction", 1.5, r"in \[0, 1\)"),
])
def test_bad_numbers_name_the_flag(name: str, value: float, what: str) -> None:
    with pytest.raises(UsageError, match=f"^{flag(name)} must be {what}$"):
        TrainConfig(**{name: value}).validate()


def test_edge_values_that_are_allowed() -> None:
    TrainConfig(test_fraction=0.0, weight_decay=0.0, momentum=0.0, num_workers=0,
                clip_grad=1e-3, max_steps=1).validate()


@pytest.mark.parametrize("batch,acc,suggest", [(10, 4, "8 or 12"), (3, 4, "4"), (65, 2, "64 or 66")])
def test_batch_not_divisible_by_accumulate_names_multiples(batch: int, acc: int, suggest: str) -> None:
    with pytest.raises(UsageError) as info:
        TrainConfig(batch_size=batch, accumulate=acc).validate()
    msg = str(info.value)
    assert f"--batch-size {batch}" in msg and f"multiple of {acc}" in msg
    assert msg.endswith(f"such as {suggest}")
    # and every value it suggests is accepted
    for option in suggest.split(" or "):
        TrainConfig(batch_size=int(option), accumulate=acc).validate()


@pytest.mark.parametrize("name,value", [("optimizer", "rmsprop"), ("precision", "fp8"),
                                        ("strategy", "magic"), ("optimizer", "ADAM")])
def test_bad_choices_list_the_choices(name: str, value: str) -> None:
    allowed = SETTINGS[name].choices
    with pytest.raises(UsageError) as info:
        TrainConfig(**{name: value}).validate()
    msg = str(info.value)
    assert msg.startswith(f"{flag(name)} {value!r} is not one of")
    assert all(c in msg for c in allowed)


def test_replace_returns_a_new_frozen_config() -> None:
    cfg = TrainConfig()
    other = cfg.replace(epochs=3)
    assert other.optim.epochs == 3 and cfg.optim.epochs == 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, "epochs", 5)   # a flat name is no way around it either


# --- coerce -----------------------------------------------------------------------------

def test_coerce_converts_strings_from_flags() -> None:
    assert coerce("batch_size", "32", "--batch-size") == 32
    assert coerce("lr", "1e-3", "--lr") == pytest.approx(1e-3)
    assert coerce("progress", "no", "x") is False
    assert coerce("progress", "True", "x") is True
    assert coerce("max_steps", "none", "x") is None
    assert coerce("lr", 1, "x") == 1.0 and isinstance(coerce("lr", 1, "x"), float)
    assert coerce("epochs", 3.0, "x") == 3


@pytest.mark.parametrize("name,value", [("batch_size", "abc"), ("batch_size", 2.5), ("batch_size", True),
                                        ("lr", "fast"), ("lr", True), ("progress", "maybe"),
                                        ("progress", 1), ("model", 3), ("epochs", "none")])
def test_coerce_rejects_wrong_types(name: str, value: object) -> None:
    with pytest.raises(UsageError, match=f"^SRC: {name} must be "):
        coerce(name, value, "SRC")


# --- TOML loading -----------------------------------------------------------------------

def test_load_flat_file(tmp_path: Path) -> None:
    path = _write(tmp_path, 'model = "biggernet"\nbatch_size = 128\nlr = 0.5\nprogress = false\n'
                            "clip_grad = 1\n")
    values = load_toml(path)
    assert values == {"model": "biggernet", "batch_size": 128, "lr": 0.5, "progress": False,
                      "clip_grad": 1.0}
    assert isinstance(values["clip_grad"], float)


def test_load_train_table(tmp_path: Path) -> None:
    path = _write(tmp_path, "[train]\nepochs = 3\ndata = \"random\"\n")
    assert load_toml(path) == {"epochs": 3, "data": "random"}


def test_load_hyphenated_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "batch-size = 32\nn-samples = 100\ndrop-last = true\n")
    assert load_toml(path) == {"batch_size": 32, "n_samples": 100, "drop_last": True}


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    path = _write(tmp_path, "epoch = 3\n")
    with pytest.raises(UsageError, match=r"unknown setting 'epoch' \(did you mean 'epochs'\?\)"):
        load_toml(path)


def test_unknown_key_without_a_close_match(tmp_path: Path) -> None:
    path = _write(tmp_path, "zzzzzz = 3\n")
    with pytest.raises(UsageError) as info:
        load_toml(path)
    assert "unknown setting 'zzzzzz'" in str(info.value)
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("text,name", [('epochs = "three"\n', "epochs"), ("lr = true\n", "lr"),
                                       ("model = 5\n", "model"), ("progress = 1\n", "progress"),
                                       ("batch_size = 2.5\n", "batch_size")])
def test_wrong_type_names_file_and_setting(tmp_path: Path, text: str, name: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(UsageError) as info:
        load_toml(path)
    msg = str(info.value)
    assert str(path) in msg and f"{name} must be" in msg


def test_invalid_toml(tmp_path: Path) -> None:
    path = _write(tmp_path, "epochs = = 3\n")
    with pytest.raises(UsageError, match="is not valid TOML"):
        load_toml(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")


def test_directory_as_file_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot be read"):
        load_toml(tmp_path)


def test_unreadable_file(tmp_path: Path) -> None:
    """chmod 000. Root reads any file: as root (CI), the read is made in a child without the
    capabilities that let root pass file permissions (setpriv, from util-linux)."""
    import shutil
    import subprocess
    import sys

    path = _write(tmp_path, "epochs = 3\n")
    path.chmod(0)
    try:
        if os.geteuid() != 0:
            with pytest.raises(UsageError, match="cannot be read"):
                load_toml(path)
            return
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is needed to drop root's file-permission override"
        code = ("import sys\nfrom scaleloop.config import load_toml\nfrom scaleloop.errors import UsageError\n"
                f"try:\n    load_toml({str(path)!r})\nexcept UsageError as exc:\n    print(exc)\n    sys.exit(3)\n")
        src = Path(__file__).resolve().parents[1] / "src"
        res = subprocess.run([setpriv, "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(src)})
        assert res.returncode == 3 and "cannot be read" in res.stdout, res.stdout + res.stderr
    finally:
        path.chmod(0o644)


def test_a_file_whose_read_fails_even_for_root() -> None:
    """chmod 000 does not stop root (CI runs as root): a file that exists and cannot be read by anyone."""
    path = Path("/proc/self/mem")   # reading it at offset 0 fails with EIO
    if not path.exists():
        pytest.skip("no /proc/self/mem on this platform")
    with pytest.raises(UsageError, match="cannot be read"):
        load_toml(path)


def test_non_utf8_file_cannot_be_read(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'model = "caf\xe9"\n')
    with pytest.raises(UsageError, match="cannot be read"):
        load_toml(path)


# --- precedence and round trip ----------------------------------------------------------

def test_resolve_precedence() -> None:
    cfg = resolve({"epochs": 3, "lr": 0.5}, {"epochs": 1})
    assert cfg.optim.epochs == 1          # flag beats file
    assert cfg.optim.lr == 0.5            # file beats default
    assert cfg.optim.batch_size == 64     # default where nobody said anything


def test_resolve_validates_the_merged_result() -> None:
    # each part is fine alone; only together do they conflict
    with pytest.raises(UsageError, match="does not split"):
        resolve({"batch_size": 10}, {"accumulate": 4})


def test_resolve_from_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[train]\nepochs = 3\nbatch-size = 32\n")
    assert resolve(load_toml(path), {"batch_size": 16}) == TrainConfig(epochs=3, batch_size=16)


@pytest.mark.parametrize("cfg", [
    TrainConfig(),
    TrainConfig(lr=1e-05, weight_decay=1e-16, momentum=0.0, clip_grad=0.5, max_steps=7,
                data_dir="/tmp/some dir", out='we"ird\\path', drop_last=True, progress=False,
                tensorboard=False, test_fraction=0.0, optimizer="sgd", precision="bf16"),
    TrainConfig(lr=3.0, clip_grad=1e20, data="pkg.mod:make", model="a.b:c"),
    # control characters must be escaped (TOML forbids them raw); non-ASCII stays as it is
    TrainConfig(out="runs/line\nbreak\ttab\x7fdel\x01", data_dir="données/数字 😀"),
])
def test_to_toml_round_trips(tmp_path: Path, cfg: TrainConfig) -> None:
    text = to_toml(cfg)
    path = _write(tmp_path, text)
    back = resolve(load_toml(path), {})
    assert back == cfg
    for name in SETTINGS:
        assert type(getattr(back, name)) is type(getattr(cfg, name)), name
    assert [line for line in text.splitlines() if line.startswith("[")] == [f"[{s}]" for s in SECTIONS]


def test_to_toml_marks_unset_fields() -> None:
    text = to_toml(TrainConfig())
    assert "# max_steps = (not set)" in text
    assert "progress = true" in text
    assert 'model = "simplenet"' in text


# --- optimizer settings of language-model training (betas, eps, min-lr, decay-params) ----------

def test_new_optimizer_settings_default_to_what_runs_did_before() -> None:
    cfg = TrainConfig().validate()
    assert (cfg.optim.betas, cfg.optim.eps, cfg.optim.min_lr, cfg.optim.weight_decay) == (None, None, 0.0, 0.0)
    assert cfg.optim.decay_params == "ndim2"
    assert cfg.optim.adam_betas is None


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_betas_parse_for_the_adam_family(optimizer: str) -> None:
    cfg = TrainConfig(optimizer=optimizer, betas="0.9,0.95", eps=1e-6).validate()
    assert cfg.optim.adam_betas == (0.9, 0.95) and cfg.optim.eps == 1e-6


@pytest.mark.parametrize("betas", ["0.9", "a,b", "0.9,1.0", "0.9,0.95,0.99", "-0.1,0.9", ""])
def test_malformed_betas_say_what_is_expected(betas: str) -> None:
    with pytest.raises(UsageError) as exc:
        TrainConfig(optimizer="adamw", betas=betas).validate()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"--betas {betas!r}") and "e.g. --betas 0.9,0.95" in msg


@pytest.mark.parametrize("given,flags", [({"betas": "0.9,0.95"}, "--betas"), ({"eps": 1e-6}, "--eps"),
                                         ({"betas": "0.9,0.95", "eps": 1e-6}, "--betas and --eps")])
def test_betas_and_eps_with_sgd_are_refused(given: dict, flags: str) -> None:
    with pytest.raises(UsageError) as exc:
        TrainConfig(optimizer="sgd", **given).validate()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(flags) and "--optimizer sgd has no such setting" in msg


@pytest.mark.parametrize("eps", [0.0, -1e-8])
def test_eps_must_be_positive(eps: float) -> None:
    with pytest.raises(UsageError, match="--eps must be a positive number"):
        TrainConfig(eps=eps).validate()


@pytest.mark.parametrize("changes,needle", [
    ({"min_lr": -1.0, "lr_schedule": "cosine"}, "--min-lr must be zero or positive"),
    ({"min_lr": 1e-4}, "--lr-schedule constant does not decay"),
    ({"min_lr": 1e-4, "warmup_steps": 5}, "--lr-schedule constant does not decay"),
    ({"min_lr": 0.01, "lr_schedule": "cosine"}, "must be below the peak learning rate 0.01"),
    # the peak is --lr scaled to the batch: sqrt(64/256) x 0.01 = 0.005
    ({"min_lr": 0.006, "lr_schedule": "step", "lr_scaling": "sqrt", "base_batch_size": 256},
     "must be below the peak learning rate 0.005"),
])
def test_bad_min_lr_says_why(changes: dict, needle: str) -> None:
    with pytest.raises(UsageError) as exc:
        TrainConfig(**changes).validate()
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_min_lr_below_the_scaled_peak_is_allowed() -> None:
    cfg = TrainConfig(lr=0.01, min_lr=0.015, lr_schedule="cosine", lr_scaling="linear", base_batch_size=32)
    assert cfg.validate().peak_lr == pytest.approx(0.02)


def test_decay_params_choices_are_checked() -> None:
    with pytest.raises(UsageError, match="--decay-params 'weights' is not one of: ndim2, ndim2-no-embeddings, all"):
        TrainConfig(decay_params="weights").validate()


def test_betas_as_a_toml_list(tmp_path: Path) -> None:
    path = _write(tmp_path, "optimizer = 'adamw'\nbetas = [0.9, 0.95]\neps = 1e-6\nmin-lr = 1e-4\n"
                            "lr_schedule = 'cosine'\ndecay-params = 'all'\n")
    cfg = resolve(load_toml(path), {})
    assert cfg.optim.betas == "0.9,0.95" and cfg.optim.adam_betas == (0.9, 0.95)
    assert (cfg.optim.eps, cfg.optim.min_lr, cfg.optim.decay_params) == (1e-6, 1e-4, "all")


def test_a_config_saved_before_these_settings_existed_still_loads(tmp_path: Path) -> None:
    old = "\n".join(line for line in to_toml(TrainConfig(optimizer="adamw", weight_decay=0.1)).splitlines()
                    if not line.lstrip("# ").startswith(("betas", "eps", "min_lr", "decay_params")))
    cfg = resolve(load_toml(_write(tmp_path, old)), {})
    assert cfg == TrainConfig(optimizer="adamw", weight_decay=0.1)


def test_new_optimizer_settings_round_trip_through_toml(tmp_path: Path) -> None:
    cfg = TrainConfig(optimizer="adamw", betas="0.9,0.95", eps=1e-6, min_lr=1e-4, lr_schedule="cosine",
                      weight_decay=0.1, decay_params="ndim2-no-embeddings").validate()
    assert resolve(load_toml(_write(tmp_path, to_toml(cfg))), {}) == cfg


# --- the sections: every setting declared once, the flat view generated from them --------------

def test_every_setting_is_declared_once_with_its_help() -> None:
    """A flat name in two sections (or named as a section) would make the flat view, the flags and
    the TOML keys ambiguous; a field without help would be a flag nobody can read about."""
    owners: dict[str, list[str]] = {}
    for section in dataclasses.fields(TrainConfig):
        for f in dataclasses.fields(section.default_factory):
            owners.setdefault(f.name, []).append(section.name)
            assert isinstance(f.metadata.get("help"), str) and f.metadata["help"].strip(), f"{section.name}.{f.name}"
            assert f.metadata["group"] in GROUPS and isinstance(f.metadata["choices"], Sequence), f.name
    assert {name: where for name, where in owners.items() if len(where) > 1} == {}
    assert not set(owners) & set(SECTIONS)
    assert set(owners) == set(SETTINGS) and len(SETTINGS) == 89
    assert all(SETTINGS[name].section == where[0] for name, where in owners.items())


def test_the_flat_view_reads_and_replaces_through_the_sections() -> None:
    cfg = TrainConfig(lr=0.5, nproc=2, strategy="ddp")
    assert (cfg.optim.lr, cfg.launch.nproc, cfg.parallel.strategy) == (cfg.optim.lr, cfg.launch.nproc, cfg.parallel.strategy) == (0.5, 2, "ddp")
    other = cfg.replace(lr=0.25, nnodes=1, optim=OptimSettings(epochs=3))
    assert other.optim.lr == 0.25 and other.optim.epochs == 3 and other.launch.nproc == 2
    assert cfg.optim.lr == 0.5   # the original is untouched
    assert TrainConfig(optim=OptimSettings(lr=0.5)) == TrainConfig(lr=0.5)
    assert list(cfg.flat()) == list(SETTINGS) and cfg.flat()["nproc"] == 2
    with pytest.raises(TypeError, match="no setting 'learning_rate'"):
        TrainConfig(learning_rate=0.1)
    with pytest.raises(AttributeError):
        cfg.learning_rate  # noqa: B018


def test_load_sections_as_tables(tmp_path: Path) -> None:
    path = _write(tmp_path, '[optim]\nepochs = 3\nlr = 0.5\n\n[launch]\nnproc = 2\n\n[model_data]\ndata = "random"\n')
    assert load_toml(path) == {"epochs": 3, "lr": 0.5, "nproc": 2, "data": "random"}


def test_a_key_in_the_wrong_table_says_where_it_belongs(tmp_path: Path) -> None:
    path = _write(tmp_path, "[launch]\nlr = 0.5\n")
    with pytest.raises(UsageError, match=r"unknown setting '\[launch\] lr' \(it belongs in \[optim\]\)"):
        load_toml(path)


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, "lr = 0.1\n[optim]\nlr = 0.5\n")
    with pytest.raises(UsageError, match="lr is given twice"):
        load_toml(path)


def test_a_config_toml_written_by_the_flat_main_still_reads(tmp_path: Path) -> None:
    """tests/fixtures/config-2026-11-26.toml: written by ``to_toml`` of the main of 2026-11-26, when
    the config was one flat dataclass and its file flat keys."""
    cfg = resolve(load_toml(FIXTURES / "config-2026-11-26.toml"), {})
    assert (cfg.optim.lr, cfg.optim.epochs, cfg.launch.nproc, cfg.parallel.strategy) == (0.05, 3, 2, "ddp")
    assert (cfg.checkpointing.out, cfg.checkpointing.shared_fs, cfg.evaluation.eval_batches) == ("runs/old", "no", 2)
    assert (cfg.parallel.precision, cfg.model_data.pin_memory, cfg.optim.decay_params) == ("bf16", False, "all")
    # and written again in sections, it reads back to the same run
    assert resolve(load_toml(_write(tmp_path, to_toml(cfg))), {}) == cfg


def test_a_bad_value_from_a_file_names_the_file_and_key(tmp_path: Path) -> None:
    path = _write(tmp_path, "epochs = -3\n")
    with pytest.raises(UsageError) as info:
        resolve(load_toml(path), {})
    assert str(info.value) == f"config file {str(path)!r}: epochs = -3: --epochs must be a positive integer"
    tabled = _write(tmp_path, "[optim]\nlr = -1.0\n", "tabled.toml")
    with pytest.raises(UsageError, match=r"^config file .*tabled.toml': \[optim\] lr = -1.0: --lr must be"):
        resolve(load_toml(tabled), {})
    # a flag given over the file's value is named as the flag
    with pytest.raises(UsageError, match="^--epochs must be a positive integer$"):
        resolve(load_toml(path), {"epochs": 0})
    resolve(load_toml(path), {"epochs": 2})


def test_a_bad_value_in_a_resumed_runs_config_names_that_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "checkpoints" / "step-1" / "manifest.json").write_text("{}")
    (run / "config.toml").write_text(to_toml(TrainConfig()).replace("epochs = 20", "epochs = -3"))
    with pytest.raises(UsageError) as info:
        config_for_resume({}, {"out": str(run)})
    msg = str(info.value)
    assert msg.startswith(f"config file {str(run / 'config.toml')!r}: [optim] epochs = -3: --epochs must be")


def test_replica_groups_are_refused_in_one_line_where_they_cannot_run() -> None:
    """--replica-groups (torchft): ddp or fsdp inside each group, whole groups, and a group's own flags."""
    ok = TrainConfig(replica_groups=2, nproc=2, strategy="ddp", batch_size=64).validate()
    assert ok.launch.data_ranks == 2
    assert TrainConfig(replica_groups=2, nproc=4, strategy="fsdp", batch_size=64).validate().launch.data_ranks == 4
    one_group = TrainConfig(replica_groups=2, replica_group=1, lighthouse="h:29510", nproc=2, batch_size=64)
    assert one_group.validate().launch.data_ranks == 4   # the batch is split over both groups' processes
    for settings, said in [
        (dict(replica_groups=2, nproc=2, strategy="pipeline"), "--strategy pipeline is not supported with it; use "
                                                                 "--strategy ddp or fsdp"),
        (dict(replica_groups=2, nproc=2, mesh="dp=2"), "--mesh dp=2 is not supported with it"),
        (dict(replica_groups=2, nproc=2, precision="fp16"), "does not take --precision fp16"),
        (dict(replica_groups=2, nproc=3), "--nproc 3 does not split into --replica-groups 2"),
        (dict(replica_groups=2, nproc=2, nnodes=2, master_addr="h"), "each replica group runs on one machine"),
        (dict(replica_groups=2, replica_group=1), "add --lighthouse HOST:PORT"),
        (dict(replica_groups=2, replica_group=2, lighthouse="h:1"), "--replica-group must be in 0..1"),
        (dict(lighthouse="h:1"), "--lighthouse names a replica group's place"),
    ]:
        with pytest.raises(UsageError, match=said.replace("(", r"\(").replace(")", r"\)")):
            TrainConfig(**settings).validate()


def test_replica_groups_without_torchft_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else found(name, *a))
    with pytest.raises(UsageError, match=r"pip install 'scaleloop\[ft\]'"):
        TrainConfig(replica_groups=2, nproc=2).validate()
