"""The host's work per layout: what is measured (FSDP and tensor parallelism, on a fake group at
tiny widths), how a deeper model scales it, and how the step time takes it on a CPU and a GPU."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from scaleloop.cli import main
from scaleloop.plan.hostwork import HostWork, key, measure_host_work, measured_by_fake_group, tiny_spec
from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import Options
from scaleloop.plan.profile import ModelSpec, profile_model
from scaleloop.plan.target import GPUS
from scaleloop.plan.timing import step_time

SPEC = ModelSpec(seq_len=16, vocab_size=32, d_model=16, n_layers=2, n_heads=2)


def test_only_layouts_a_fake_group_runs_are_measured_and_offload_shares_its_layout() -> None:
    assert measured_by_fake_group(Layout("fsdp", fsdp=2)) and measured_by_fake_group(Layout("fsdp x tp", tp=2))
    assert not measured_by_fake_group(Layout("dp", dp=2))
    assert not measured_by_fake_group(Layout("pp x dp", pp=2, dp=2, microbatches=4))
    assert key(Layout("fsdp", fsdp=2, offload=True)) == key(Layout("fsdp", fsdp=2))
    assert tiny_spec(replace(SPEC, model="config.json")) is None
    tiny = tiny_spec(replace(SPEC, n_layers=32, n_heads=8))
    assert tiny is not None and (tiny.n_layers, tiny.d_model, tiny.n_heads) == (4, 16, 8)


def test_a_deeper_model_scales_the_measured_work_by_its_blocks() -> None:
    host = HostWork({"fsdp fsdp=2": 0.010}, plain_s=0.002, measured_blocks=4, blocks=32, plain_checkpointed_s=0.003)
    assert host.extra(Layout("fsdp", fsdp=2)) == pytest.approx(0.080)
    assert host.total(Layout("fsdp", fsdp=2, offload=True)) == pytest.approx(0.096)
    assert host.total(Layout("dp", dp=2, checkpointing=True)) == pytest.approx(0.024)   # the recomputed forward
    assert host.total(Layout("pp x dp", pp=2, dp=1, microbatches=4)) == pytest.approx(0.008)   # half the blocks
    assert host.extra(Layout("dp", dp=2)) == 0.0
    inverted = HostWork({"fsdp fsdp=2": 0.010, "fsdp fsdp=2 +ac": 0.008}, 0.002, 4, 4)
    assert inverted.extra(Layout("fsdp", fsdp=2, checkpointing=True)) == pytest.approx(0.010)
    assert HostWork().total(Layout("fsdp", fsdp=2)) == 0.0


def test_checkpointing_adds_its_own_work_beyond_the_recomputed_forward() -> None:
    # The plain tiny step 6 ms, with checkpointing 10 ms: 8 ms is the forward again (the
    # compute's 4/3), 2 ms the checkpointing's own, on every layout that checkpoints.
    host = HostWork({"fsdp fsdp=2 +ac": 0.010}, plain_s=0.006, measured_blocks=4, blocks=8, plain_checkpointed_s=0.010)
    assert host.checkpointing(Layout("dp", dp=2, checkpointing=True)) == pytest.approx(0.004)   # twice as deep
    assert host.extra(Layout("dp", dp=2, checkpointing=True)) == pytest.approx(0.004)
    assert host.extra(Layout("fsdp", fsdp=2, checkpointing=True)) == pytest.approx(0.020 + 0.004)
    assert host.checkpointing(Layout("pp x dp", pp=2, dp=1, microbatches=4, checkpointing=True)) == pytest.approx(0.002)
    assert host.checkpointing(Layout("dp", dp=2)) == 0.0
    assert HostWork({}, 0.006, 4, 4, plain_checkpointed_s=0.007).checkpointing(
        Layout("dp", dp=2, checkpointing=True)) == 0.0   # less than the forward again: nothing of its own


def test_a_pipeline_stage_dispatches_its_pieces_beyond_one_plain_pass() -> None:
    # Each of M pieces runs 1/S of the blocks: M/S plain passes, one of which the compute holds.
    host = HostWork({}, plain_s=0.006, measured_blocks=4, blocks=8)
    assert host.pipeline(Layout("pp x dp", pp=2, dp=2, microbatches=4)) == pytest.approx(0.012)
    assert host.pipeline(Layout("pp x dp", pp=4, microbatches=16)) == pytest.approx(0.036)
    assert host.pipeline(Layout("pp x dp", pp=4, microbatches=4)) == 0.0
    assert host.pipeline(Layout("dp", dp=4)) == 0.0 and HostWork().pipeline(Layout("pp x dp", pp=2, microbatches=4)) == 0.0
    profile, options = profile_model(SPEC), Options(8, "fp32", "adam", accumulate=2)
    layout = Layout("pp x dp", pp=2, dp=2, microbatches=4)
    cpu = replace(GPUS["h100"], per_node=4, overlaps=False, host_share=2.0)
    without, with_host = step_time(profile, layout, options, cpu, 0.4), step_time(profile, layout, options, cpu, 0.4, host)
    assert with_host.total_s - without.total_s == pytest.approx(0.012 * 2 * 2.0)   # per optimizer step's passes


def test_a_cpu_adds_the_layouts_work_and_a_gpu_is_bound_below_by_the_hosts_whole_work() -> None:
    profile = profile_model(SPEC)
    layout, options = Layout("fsdp", fsdp=2), Options(4, "fp32", "adam")
    host = HostWork({key(layout): 0.5}, plain_s=0.25, measured_blocks=2, blocks=2)
    cpu = replace(GPUS["h100"], per_node=2, overlaps=False, host_share=2.0)
    without, with_host = step_time(profile, layout, options, cpu, 0.4), step_time(profile, layout, options, cpu, 0.4, host)
    assert with_host.total_s == pytest.approx(without.total_s + 0.5 * 2.0) and with_host.host_s == pytest.approx(1.0)
    gpu = replace(GPUS["h100"], per_node=2)
    assert step_time(profile, layout, options, gpu, 0.4, host).total_s == pytest.approx(0.75)   # the GPU is idle


def test_the_host_work_is_measured_per_layout_and_the_plan_says_so(capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    layouts = [Layout("dp", dp=2), Layout("fsdp", fsdp=2), Layout("fsdp", fsdp=2, offload=True),
               Layout("fsdp x tp", tp=2, checkpointing=True)]
    host = measure_host_work(SPEC, layouts, rounds=2)
    assert set(host.extra_s) == {"fsdp fsdp=2", "fsdp x tp tp=2 +ac"}
    assert all(math.isfinite(v) and v >= 0 for v in host.extra_s.values()) and host.plain_s > 0
    assert (host.measured_blocks, host.blocks) == (2, 2)
    assert measure_host_work(replace(SPEC, model="config.json"), layouts) == HostWork()

    # The command's wiring, with the measurement above standing in for a second one.
    monkeypatch.setattr("scaleloop.plan.planner.measure_host_work", lambda spec, layouts: host)
    argv = ["plan", "--gpus", "2", "--gpu", "h100", "--d-model", "16", "--n-heads", "2", "--n-layers", "2",
            "--batch-size", "4"]
    assert main([*argv, "--measure-host"]) == 0
    out = capsys.readouterr().out
    assert "host work measured on this machine's CPU at tiny widths" in out and "host-bound: " in out
    assert main(argv) == 0
    assert "--measure-host measures it here" in capsys.readouterr().out
