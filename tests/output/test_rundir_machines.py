"""A run directory that the machines of one job share (a Kubeflow job's ReadWriteMany claim, one
--out on a shared file system): the machine whose launcher comes second finds the job's
config.toml, written moments ago by another machine's launcher, and no step taken yet. That is no
run that stopped before its first step: nothing of it is removed, and nothing is said."""
from __future__ import annotations

from pathlib import Path

import pytest

from scaleloop.output.rundir import another_machine_starting, prepare_run_dir

HEAD = "# scaleloop resolved configuration; rerun with: scaleloop train --config <this file>\n"


def config(nnodes: int) -> str:
    return HEAD + f'\n[model_data]\nmodel = "convnet"\n\n[launch]\nnproc = 1\nnnodes = {nnodes}\nmin_nnodes = 0\n'


@pytest.mark.parametrize("metrics", [False, True], ids=["config-only", "metrics-header-too"])
def test_another_machines_fresh_start_in_a_shared_out_is_left_alone_in_silence(tmp_path: Path, metrics: bool) -> None:
    (tmp_path / "config.toml").write_text(config(2))
    if metrics:   # rank 0 may have opened it already (an elastic job admitting a late machine)
        (tmp_path / "metrics.csv").write_text("kind,epoch,step,samples\n")
    said: list[str] = []
    assert another_machine_starting(tmp_path)
    assert prepare_run_dir(str(tmp_path), "convnet", "digits", say=said.append) == tmp_path
    assert said == []
    assert (tmp_path / "config.toml").read_text() == config(2)
    assert (tmp_path / "metrics.csv").exists() == metrics


def test_a_several_machine_start_that_failed_is_started_over_and_said(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(config(2))
    (tmp_path / "failure.json").write_text("{}")   # each machine's launcher records a failed start
    said: list[str] = []
    assert not another_machine_starting(tmp_path)
    prepare_run_dir(str(tmp_path), "convnet", "digits", say=said.append)
    assert len(said) == 1 and "held a run that stopped before its first step" in said[0]
    assert list(tmp_path.iterdir()) == []


def test_one_machines_leftover_config_is_still_a_stopped_run(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(config(1))
    said: list[str] = []
    assert not another_machine_starting(tmp_path)
    prepare_run_dir(str(tmp_path), "convnet", "digits", say=said.append)
    assert len(said) == 1 and "stopped before its first step" in said[0]
