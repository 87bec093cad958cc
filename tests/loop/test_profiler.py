"""``scaleloop train --profile`` on one process, ``scaleloop.profile`` in a hand-written loop, and
the trace's reading (``output.profile_trace``) on a made-up trace whose answer is known.

- a profiled run writes a trace (Chrome JSON with the step ranges and operators), a summary whose
  parts add up to the step time, and a PNG; it prints the table, and ``doctor``/``plot`` print it
  again; it trains bitwise the weights of the same run without ``--profile``;
- ``--profile`` alone is 3 steps, a value is that many, a missing key (an older config.toml) is off;
- communication that no compute covers is exposed, the rest overlapped; the slowest rank and why.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

import scaleloop as sl
from scaleloop.cli import build_parser
from scaleloop.commands.cmdline import flag_values
from scaleloop.config import resolve
from scaleloop.output.profile_summary import combine
from scaleloop.output.profile_trace import PARTS, analyse, intersect, subtract, union

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from procs import child_env, run  # noqa: E402

pytestmark = pytest.mark.slow

TRAIN = ["--data", "random", "--n-samples", "512", "--batch-size", "64", "--max-steps", "5", "--log-every", "1", "--no-progress",
         "--no-tensorboard", "--no-checkpoints", "--device", "cpu"]


def scaleloop(*args: str, cwd: Path, stderr: Optional[list[str]] = None) -> str:
    """What ``scaleloop ARGS`` printed on stdout (its stderr appended to ``stderr``, if given)."""
    res = run([sys.executable, "-m", "scaleloop", *args], cwd=cwd, timeout=120,
              env=child_env({"OMP_NUM_THREADS": "1"}))
    assert res.returncode == 0, f"scaleloop {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}"
    if stderr is not None:
        stderr.append(res.stderr)
    return res.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One run profiled (2 steps after the warm-up) and the same run without, each started as a user would."""
    root = tmp_path_factory.mktemp("profile")
    stderr: list[str] = []
    printed = scaleloop("train", *TRAIN, "--profile", "2", "--out", str(root / "profiled"), cwd=root, stderr=stderr)
    scaleloop("train", *TRAIN, "--out", str(root / "plain"), cwd=root)
    return {"root": root, "printed": printed, "stderr": stderr[0], "dir": root / "profiled"}


def test_the_trace_is_chrome_json_with_the_steps_and_their_operators(runs) -> None:
    trace = json.loads((runs["dir"] / "profile" / "rank-0.pt.trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert names.count("scaleloop.step") == 2
    assert {"scaleloop.data", "scaleloop.forward_backward", "scaleloop.optimizer"} <= set(names)
    assert any(n.startswith("aten::addmm") for n in names) and any(n.startswith("autograd::engine") for n in names)


def test_the_summary_splits_each_step_into_parts_that_add_up(runs) -> None:
    summary = json.loads((runs["dir"] / "profile" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["first_step"] == 3 and summary["strategy"] == "single"
    rank = summary["ranks"][0]
    assert rank["steps"] == 2 and len(rank["steps_ms"]) == 2
    parts = rank["parts_ms"]
    assert set(parts) == set(PARTS)
    assert sum(parts.values()) == pytest.approx(rank["step_ms"], rel=1e-6)
    assert parts["forward"] > 0 and parts["backward"] > 0 and parts["optimizer"] > 0 and parts["data wait"] > 0
    assert rank["comm_ms"] == 0 and parts["comm exposed"] == 0   # one process: nothing to communicate
    assert rank["top_ops"] and all(op["self_ms"] >= 0 for op in rank["top_ops"])
    assert summary["slowest"]["text"] == "one rank: no other to compare with"


def test_the_timeline_is_a_png(runs) -> None:
    assert (runs["dir"] / "profile" / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_run_prints_the_table_and_doctor_and_plot_print_it_again(runs, capsys) -> None:
    assert "profile: 2 step(s) (steps 3-4) on 1 rank(s)" in runs["printed"]
    assert "slowest: one rank" in runs["printed"]
    doctor = scaleloop("doctor", str(runs["dir"]), cwd=runs["root"])
    assert "profile: 2 step(s) (steps 3-4)" in doctor and "top operators, rank 0" in doctor
    assert sl.cli.main(["plot", str(runs["dir"]), "--out", str(runs["root"] / "compare.png")]) == 0
    assert "top operators, rank 0" in capsys.readouterr().out


def test_the_profiler_s_own_log_lines_stay_off_the_console(runs) -> None:
    # Kineto, torch's C++ profiler, writes "USDT:... profiler_start" lines straight to the process's
    # stderr (its file descriptor, below Python) unless KINETO_LOG_LEVEL says otherwise.
    assert "USDT" not in runs["stderr"] and "profiler_start" not in runs["stderr"], runs["stderr"]
    assert "profile: 2 step(s)" in runs["printed"]   # the profile itself was taken


def test_a_profiled_run_trains_the_same_weights_bitwise(runs) -> None:
    profiled = torch.load(runs["dir"] / "model.pt", weights_only=True)
    plain = torch.load(runs["root"] / "plain" / "model.pt", weights_only=True)
    assert profiled.keys() == plain.keys()
    assert all(torch.equal(profiled[k], plain[k]) for k in plain)
    assert not (runs["root"] / "plain" / "profile").exists()


def test_off_nothing_of_the_profiler_is_imported(tmp_path: Path) -> None:
    code = ("import sys; from scaleloop.cli import main; main(['train', *sys.argv[1:]]); "
            "print('imported:', sorted(m for m in sys.modules if 'profile_' in m or m.endswith('loop.profiler')))")
    res = run([sys.executable, "-c", code, *TRAIN, "--max-steps", "3", "--out", str(tmp_path / "off")], cwd=tmp_path,
              timeout=120, env=child_env({"OMP_NUM_THREADS": "1"}))
    assert res.returncode == 0, res.stderr
    assert "imported: []" in res.stdout


@pytest.mark.parametrize("argv,steps", [([], 0), (["--profile"], 3), (["--profile", "5"], 5),
                                        (["--profile", "--max-steps", "4"], 3)])
def test_the_flag_alone_is_three_steps_a_value_that_many_none_off(argv: list[str], steps: int) -> None:
    args = build_parser().parse_args(["train", *argv])
    assert resolve({}, flag_values(args)).profile == steps


def test_a_config_toml_without_the_key_is_off(tmp_path: Path) -> None:
    old = tmp_path / "config.toml"
    old.write_text('[optim]\nlr = 0.1\n[output]\nlog_every = 5\n')
    args = build_parser().parse_args(["train", "--config", str(old)])
    assert resolve(sl.config.load_toml(old), flag_values(args)).profile == 0


def test_the_library_form_profiles_a_hand_written_loop(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    printed: list[str] = []
    with sl.profile(tmp_path / "prof", steps=2, warmup=1, say=printed.append) as prof:
        for _ in range(4):
            with prof.phase("data"):
                x, y = torch.randn(16, 8), torch.randn(16, 1)
            with prof.phase("forward"):
                loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            with prof.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()
            prof.step()
    summary = json.loads((tmp_path / "prof" / "summary.json").read_text())
    parts = summary["ranks"][0]["parts_ms"]
    assert summary["ranks"][0]["steps"] == 2 and summary["first_step"] == 2
    assert all(parts[p] > 0 for p in ("data wait", "forward", "backward", "optimizer"))
    assert printed[0].startswith("profile: 2 step(s) (steps 2-3)")


# --- the trace's reading, on a made-up trace ---------------------------------------------------

def _event(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat}


def test_communication_no_compute_covers_is_exposed_the_rest_overlapped(tmp_path: Path) -> None:
    # One 1000 us step: data 0-100, forward 100-400 (an addmm 100-400), backward 400-700
    # (an autograd function), optimizer 800-1000; an all-reduce on Gloo's thread 500-900: 500-700
    # under the backward's compute (overlapped), 700-800 waited for (exposed), 800-900 under the
    # optimizer's compute (overlapped).
    events = [
        _event("scaleloop.step", 0, 1000, cat="user_annotation"),
        _event("scaleloop.data", 0, 100, cat="user_annotation"),
        _event("scaleloop.forward_backward", 100, 700, cat="user_annotation"),
        _event("aten::addmm", 100, 300),
        _event("autograd::engine::evaluate_function: AddmmBackward0", 400, 300),
        _event("aten::mm", 400, 300),
        _event("scaleloop.optimizer", 800, 200, cat="user_annotation"),
        _event("aten::add_", 800, 200),
        _event("gloo:all_reduce", 500, 400, tid=2, cat="user_annotation"),
    ]
    trace = tmp_path / "rank-0.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    numbers = analyse(trace)
    assert numbers["parts_ms"] == pytest.approx({"comm exposed": 0.1, "data wait": 0.1, "optimizer": 0.2,
                                                 "backward": 0.3, "forward": 0.3, "other": 0.0})
    assert numbers["comm_ms"] == pytest.approx(0.4) and numbers["comm_overlapped_ms"] == pytest.approx(0.3)
    top = {op["name"]: op["self_ms"] for op in numbers["top_ops"]}
    # self time: the autograd function's own time is its mm's, so it has none of its own
    assert top == pytest.approx({"aten::addmm": 0.3, "aten::mm": 0.3, "aten::add_": 0.2,
                                 "autograd::engine::evaluate_function: AddmmBackward0": 0.0})
    # A step the run left unfinished (it ended inside it: an evaluation, a checkpoint) is not counted.
    events.append(_event("scaleloop.step", 1000, 5000, cat="user_annotation"))
    trace.write_text(json.dumps({"traceEvents": events}))
    assert analyse(trace, steps=1)["step_ms"] == pytest.approx(1.0) and analyse(trace)["steps"] == 2


def test_intervals() -> None:
    a = union([(0, 2), (1, 3), (5, 6)])
    assert a == [(0, 3), (5, 6)]
    assert intersect(a, [(2, 5.5)]) == [(2, 3), (5, 5.5)]
    assert subtract(a, [(1, 2), (5, 7)]) == [(0, 1), (2, 3)]


def test_the_slowest_rank_is_named_with_the_part_that_grew() -> None:
    fast = {"step_ms": 10.0, "parts_ms": {p: 0.0 for p in PARTS} | {"forward": 6.0, "data wait": 4.0}}
    slow = {"step_ms": 13.8, "parts_ms": {p: 0.0 for p in PARTS} | {"forward": 6.1, "data wait": 7.7}}
    found = combine([fast, slow])["slowest"]
    assert found["rank"] == 1 and found["why"] == "data wait"
    assert found["text"] == "rank 1: 38% longer steps than the others' mean, its extra time is data wait (+3.70 ms a step)"
