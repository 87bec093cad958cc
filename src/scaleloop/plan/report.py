"""The plan as a ranked table, a recommendation with its ``scaleloop train`` line, and why every
other layout lost (does not fit, or slower by how much)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Sequence

from scaleloop.plan.layouts import Layout
from scaleloop.plan.memory import Memory, Options, breakdown
from scaleloop.plan.profile import ModelProfile
from scaleloop.plan.target import Target
from scaleloop.plan.timing import StepTime


@dataclass(frozen=True)
class Row:
    """One candidate: its layout, memory and time, and whether it fits."""

    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool


def rank(rows: Sequence[Row]) -> list[Row]:
    """Those that fit, fastest first; then those that do not, smallest peak first."""
    return sorted(rows, key=lambda r: (not r.fits, r.time.total_s if r.fits else r.memory.peak))


def _gb(n: float) -> str:
    """GB to one decimal, or three significant digits below 1 GB (a small model's 0.0 says nothing)."""
    return f"{n / 1e9:.1f}" if n >= 1e9 or n == 0 else f"{n / 1e9:.3g}"


def table(rows: Sequence[Row], target: Target) -> list[str]:
    """The candidates, one line each: per-rank peak and its parts (GB), fits, step time, samples/s."""
    head = ["layout", "peak GB", "params", "grads", "optim", "activ", "buffers", "host", "fits", "step s", "samples/s"]
    body = [[r.layout.label, _gb(r.memory.peak), *(_gb(v) for _, v in breakdown(r.memory)),
             _gb(r.memory.host) if r.memory.host else "-", "yes" if r.fits else "no",
             f"{r.time.total_s:.3g}", f"{r.time.samples_per_s:,.1f}"] for r in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in [head, *body]]


def why_lost(row: Row, best: Row, target: Target) -> str:
    """One line: why ``row`` is not the recommendation."""
    if not row.fits:
        return (f"{row.layout.label}: does not fit: needs {_gb(row.memory.peak)} GB per GPU, "
                f"{_gb(target.memory_bytes * target.usable)} GB usable")
    slower = row.time.total_s / best.time.total_s - 1
    return f"{row.layout.label}: {slower:.0%} slower ({row.time.total_s:.3g} s against {best.time.total_s:.3g} s per step)"


def train_command(profile: ModelProfile, layout: Layout, options: Options, target: Target, data: str) -> tuple[str, list[str]]:
    """The ``scaleloop train`` line for ``layout``, and notes on what it cannot say itself."""
    spec = profile.spec
    notes = []
    model = spec.model
    if spec.model == "tinygpt" and (spec.d_model, spec.n_layers, spec.n_heads) != (128, 2, 4):
        model = "YOUR.module:tinygpt_factory"
        notes.append(f"train's --model tinygpt has d_model 128, 2 layers and 4 heads; for these sizes give a factory: "
                     f"def tinygpt_factory(info): return scaleloop.TinyGPT(info.num_classes, info.input_shape[0], "
                     f"d_model={spec.d_model}, n_layers={spec.n_layers}, n_heads={spec.n_heads})")
    elif spec.model.endswith(".json"):
        model = "YOUR.module:factory"
        notes.append(f"train builds a Hugging Face model from a factory: return "
                     f"AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({spec.model!r}))")
    argv = ["scaleloop", "train", "--model", model, "--data", data, "--seq-len", str(spec.seq_len),
            "--vocab-size", str(spec.vocab_size), "--batch-size", str(options.batch_size),
            "--precision", options.precision, "--optimizer", options.optimizer, "--device", "cuda",
            *layout.train_flags(target.per_node, target.nodes)]
    if target.nodes > 1:
        notes.append("this is node 0's line: run it on every node with --node-rank 0..N-1 and NODE0_HOST replaced by "
                     "node 0's address (docs/multinode.md)")
    return shlex.join(argv), notes


def host_line(rows: Sequence[Row], profile: ModelProfile, measured: bool) -> str:
    """What the times say about the host's own work."""
    if not measured:
        return "host work (FSDP's hooks, DTensor's dispatch) left out of the times: --measure-host measures it here"
    bound = [r.layout.label for r in rows if r.time.host_s and r.time.host_s >= r.time.total_s * 0.999]
    if not any(r.time.host_s for r in rows):
        return (f"host work not measured for {profile.spec.model}: only tinygpt can be shrunk to tiny widths"
                if profile.spec.model != "tinygpt" else "host work: nothing to measure (no FSDP or tensor-parallel layout)")
    if len(bound) > 3:
        said = f"{len(bound)} of {len(rows)} layouts (the GPU would wait for the host: a small model)"
    else:
        said = ", ".join(bound) if bound else "none"
    return f"host work measured on this machine's CPU at tiny widths (docs/planning.md); host-bound: {said}"


def format_plan(profile: ModelProfile, rows: Sequence[Row], options: Options, target: Target, mfu: float,
                data: str, left_out: Sequence[str] = (), measured_host: bool = False) -> str:
    """The whole report ``scaleloop plan`` prints."""
    ranked = rank(rows)
    lines = [f"scaleloop plan: {profile.spec.describe()}: {profile.parameters / 1e9:.3g} B parameters, "
             f"{profile.flops_per_sample / 1e12:.3g} TFLOPs per sample (forward and backward, counted)",
             f"on {target.gpus} x {target.name} ({target.nodes} node(s) of {target.per_node}; {target.inside.name} "
             f"inside a node, {target.between.name} between), {_gb(target.memory_bytes * target.usable)} GB "
             f"usable each ({target.usable:.0%})",
             f"--batch-size {options.batch_size} (global), {options.precision}, {options.optimizer}; compute at "
             f"{mfu:.0%} MFU (an assumption: --mfu); memory estimated, not measured (docs/planning.md)",
             host_line(rows, profile, measured_host), ""]
    lines += table(ranked, target)
    best = ranked[0] if ranked and ranked[0].fits else None
    if best is None:
        lines += ["", "nothing fits: use more GPUs, a smaller --batch-size or --seq-len, or GPUs with more memory"]
        return "\n".join(lines)
    command, notes = train_command(profile, best.layout, options, target, data)
    lines += ["", f"recommended: {best.layout.label}: {best.time.total_s:.3g} s per step, "
                  f"{best.time.samples_per_s * profile.spec.seq_len:,.0f} tokens/s, {_gb(best.memory.peak)} GB per GPU",
              f"  {command}", *(f"  note: {n}" for n in notes), "why the others lost:"]
    lines += [f"  {why_lost(r, best, target)}" for r in ranked[1:]]
    lines += [f"  {line}" for line in left_out]
    return "\n".join(lines)
