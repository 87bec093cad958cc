"""A rank that stopped on bad input is reported as such, in one line, even when its usage-error
file is gone (another machine's launcher took it from a run directory they share): its log says
``scaleloop: error: ...`` last and torchrun's summary gives exit code 2. Never as a rank that
"exited with code 2 and no Python error"."""
from __future__ import annotations

from pathlib import Path

from scaleloop.launching.failures import analyse, usage_error_in_logs

MESSAGE = ("model 'convnet' needs image data shaped (channels, height, width); dataset 'random' gives samples "
           "shaped (20,); use --model simplenet or an image dataset (digits, mnist, images)")
SUMMARY = """\
[ERROR] failed (exitcode: 2) local_rank: 0 (pid: 4242) of binary: /usr/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
scaleloop.cli FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_03:54:01
  host      : pod-1
  rank      : 1 (local_rank: 0)
  exitcode  : 2 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def run_dir(tmp_path: Path, last_line: str, code: int = 2) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir(parents=True)
    (logs / "torchrun.log").write_text(SUMMARY.replace("exitcode: 2", f"exitcode: {code}")
                                       .replace("exitcode  : 2", f"exitcode  : {code}"))
    (logs / "rank-1.log").write_text("==== scaleloop worker rank 1, attempt 0 ====\n" + last_line + "\n")
    return tmp_path


def test_a_ranks_usage_error_is_read_from_its_log(tmp_path: Path) -> None:
    assert usage_error_in_logs(run_dir(tmp_path, f"scaleloop: error: {MESSAGE}"), [1]) == (1, MESSAGE)


def test_another_ending_is_no_usage_error(tmp_path: Path) -> None:
    assert usage_error_in_logs(run_dir(tmp_path / "a", "step 3 done"), [1]) is None
    assert usage_error_in_logs(run_dir(tmp_path / "b", f"scaleloop: error: {MESSAGE}", code=1), [1]) is None


def test_the_report_says_bad_input_not_no_python_error(tmp_path: Path) -> None:
    found = analyse(run_dir(tmp_path, f"scaleloop: error: {MESSAGE}"), tmp_path / "logs" / "torchrun", [1], None, 1, None)
    assert found.report[0] == f"scaleloop: error: rank 1 stopped on bad input: {MESSAGE}"
    assert not any("no Python error" in line for line in found.report)
