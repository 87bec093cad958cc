"""The plan as a ranked table, a recommendation with its ``scaleloop train`` line, and why every
other layout lost (does not fit, or slower by how much)."""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Optional, Sequence

from scaleloop.hfconfig import is_config_path
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
    """The candidates, one line each: per-rank peak, when it is reached and its parts then (GB),
    fits, step time, samples/s."""
    head = ["layout", "peak GB", "peak at", "params", "grads", "optim", "activ", "buffers", "host", "fits",
            "step s", "samples/s"]
    body = [[r.layout.label, _gb(r.memory.peak), r.memory.moment, *(_gb(v) for _, v in breakdown(r.memory)),
             _gb(r.memory.host) if r.memory.host else "-", "yes" if r.fits else "no",
             f"{r.time.total_s:.3g}", f"{r.time.samples_per_s:,.1f}"] for r in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    return ["  " + "  ".join(c.ljust(w) if i in (0, 2) else c.rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths)))
            for row in [head, *body]]


#: What each moment of ``peak at`` means, and why a part can be 0.0 there (memory.Memory.moment).
MOMENTS = {
    "forward": "inside the forward (the loss's own temporaries): no gradient yet (grads 0.0)",
    "backward start": "the forward's activations all kept, no gradient yet (grads 0.0)",
    "backward N%": "inside the backward, N% of the gradients made, the activations they needed freed "
                   "(with +ac a smaller peak, so it falls later, when gradients have grown)",
    "backward end": "every gradient made, the last activations not yet freed",
    "pieces in flight": "a 1F1B stage: the activations of its pieces in flight, its gradients all made",
    "optimizer step": "after the backward: activations and FSDP's gathered units freed (activ 0.0), every "
                      "gradient; buffers are the optimizer's temporaries (one fp32 copy of the rank's parameters "
                      "when it steps by lists, as on CUDA) and DDP's gradient buckets",
}


def _kind(moment: str) -> str:
    """``backward 63%`` as ``backward N%``: the legend explains the share once for every row."""
    return "backward N%" if moment.startswith("backward ") and moment.endswith("%") else moment


def legend(rows: Sequence[Row]) -> list[str]:
    """How to read the table: the moments its rows name, and the parts that are 0.0 by layout."""
    lines = ["per GPU, at the moment of its peak ('peak at'): the columns add up to the peak (host memory apart)"]
    kinds = list(dict.fromkeys(_kind(row.memory.moment) for row in rows))   # in the rows' order, once each
    lines += [f"  {kind}: {MOMENTS.get(kind, '')}" for kind in kinds]
    if any(r.layout.offload for r in rows):
        lines.append("  +offload: parameters, gradients and optimizer state live in host memory (host), "
                     "so 0.0 on the GPU")
    return lines


def why_lost(row: Row, best: Row, target: Target) -> str:
    """One line: why ``row`` is not the recommendation."""
    if not row.fits:
        return (f"{row.layout.label}: does not fit: needs {_gb(row.memory.peak)} GB per GPU, "
                f"{_gb(target.memory_bytes * target.usable)} GB usable")
    slower = row.time.total_s / best.time.total_s - 1
    return f"{row.layout.label}: {slower:.0%} slower ({row.time.total_s:.3g} s against {best.time.total_s:.3g} s per step)"


#: The train line's stand-ins for what only the user has, each explained in a note under it.
DATA_DIR = "YOUR_DATA_DIR"
DATA_FACTORY = "YOUR_DATA"
#: The token-file datasets: they read ``--data-dir``.
TOKEN_FILES = ("tokenfile", "tokenfile-seq")


def data_flags(data: Optional[str], data_dir: Optional[str], task: str) -> tuple[list[str], list[str]]:
    """The train line's data flags, and notes on what they leave to the user.

    ``data`` None: the user's own data, named as such: a language model's token files
    (``--data tokenfile --data-dir YOUR_DATA_DIR``), a classifier's data factory (``YOUR_DATA``);
    a placeholder is never the name of a dataset that would train on something else. A dataset
    ``data`` names is kept as given."""
    if task == "classification":
        return _classifier_data(data)
    name = data or "tokenfile"
    if name in TOKEN_FILES:
        notes = [] if data_dir else [f"{DATA_DIR}: a directory with train.bin and val.bin as nanoGPT's prepare.py "
                                     "writes them (uint16 token ids; meta.pkl or meta.json beside them may give "
                                     "vocab_size)"]
        return ["--data", name, "--data-dir", data_dir or DATA_DIR], notes
    notes = (["--data tokens is random token ids, a test of speed with nothing to learn: for your data, --data "
              f"tokenfile --data-dir {DATA_DIR}"] if name == "tokens" else [])
    return ["--data", name], notes


def _classifier_data(data: Optional[str]) -> tuple[list[str], list[str]]:
    """A classifier of token sequences needs class labels, which no built-in token data has (their
    target is the next token): the user's data factory."""
    classifies = "the model classifies (one row of class logits a sample)"
    if data is None:
        return ["--data", DATA_FACTORY], [f"{classifies}: {DATA_FACTORY} is your data factory, package.module:function, "
                                          "giving token sequences with class labels (docs/models-and-data.md)"]
    need = (f"--data {data} is next-token data: give token sequences with class labels instead"
            if data in ("tokens", *TOKEN_FILES) else f"--data {data} must give token sequences with class labels")
    return ["--data", data], [f"{classifies}: {need}, e.g. a data factory (docs/models-and-data.md)"]


def model_flags(profile: ModelProfile) -> tuple[list[str], list[str]]:
    """The train line's model flags (TinyGPT's sizes; a config's own vocabulary), and a note."""
    spec = profile.spec
    vocab = [] if profile.task == "classification" else ["--vocab-size", str(profile.vocab_size or spec.vocab_size)]
    if spec.model == "tinygpt":
        return ["--model", "tinygpt", "--d-model", str(spec.d_model), "--n-layers", str(spec.n_layers),
                "--n-heads", str(spec.n_heads), *vocab], []
    notes = []
    if is_config_path(spec.model):
        notes.append("train builds the config's model with random weights (a config has none); to start from "
                     "trained ones add --init-from DIR (a transformers directory, a .safetensors file or a run)")
    return ["--model", spec.model, *vocab], notes


def train_command(profile: ModelProfile, layout: Layout, options: Options, target: Target, data: Optional[str],
                  data_dir: Optional[str] = None) -> tuple[str, list[str]]:
    """The ``scaleloop train`` line for ``layout``, and notes on what it cannot say itself
    (``data`` None: the user's own data, named as such: :func:`data_flags`)."""
    model, model_notes = model_flags(profile)
    data_part, data_notes = data_flags(data, data_dir, profile.task)
    argv = ["scaleloop", "train", *model, *data_part, "--seq-len", str(profile.spec.seq_len),
            "--batch-size", str(options.batch_size), "--precision", options.precision,
            "--optimizer", options.optimizer, "--device", "cuda", *layout.train_flags(target.per_node, target.nodes)]
    notes = data_notes + model_notes
    if target.nodes > 1:
        notes.append("this is node 0's line: run it on every node with --node-rank 0..N-1 and NODE0_HOST replaced by "
                     "node 0's address (docs/multinode.md)")
    return shlex.join(argv), notes


def describe(profile: ModelProfile) -> str:
    """The model in the plan's first line: the spec, then its class, blocks and vocabulary."""
    what = profile.summary
    if profile.task == "classification":
        what += "; a classifier (class logits, not tokens)"
    elif profile.vocab_size and profile.spec.model != "tinygpt":   # tinygpt's spec says its own
        what += f"; vocabulary {profile.vocab_size:,}"
    return f"{profile.spec.describe()}: {what}" if what else profile.spec.describe()


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
                data: Optional[str] = None, left_out: Sequence[str] = (), measured_host: bool = False,
                data_dir: Optional[str] = None) -> str:
    """The whole report ``scaleloop plan`` prints."""
    ranked = rank(rows)
    lines = [f"scaleloop plan: {describe(profile)}: {profile.parameters / 1e9:.3g} B parameters, "
             f"{profile.flops_per_sample / 1e12:.3g} TFLOPs per sample (forward and backward, counted)",
             f"on {target.gpus} x {target.name} ({target.nodes} node(s) of {target.per_node}; {target.inside.name} "
             f"inside a node, {target.between.name} between), {_gb(target.memory_bytes * target.usable)} GB "
             f"usable each ({target.usable:.0%})",
             f"--batch-size {options.batch_size} (global), {options.precision}, {options.optimizer}; compute at "
             f"{mfu:.0%} MFU (an assumption: --mfu); memory estimated, not measured (docs/planning.md)",
             host_line(rows, profile, measured_host), ""]
    lines += table(ranked, target)
    lines += legend(ranked)
    best = ranked[0] if ranked and ranked[0].fits else None
    if best is None:
        lines += ["", "nothing fits: use more GPUs, a smaller --batch-size or --seq-len, or GPUs with more memory"]
        return "\n".join(lines)
    command, notes = train_command(profile, best.layout, options, target, data, data_dir)
    lines += ["", f"recommended: {best.layout.label}: {best.time.total_s:.3g} s per step, "
                  f"{best.time.samples_per_s * profile.spec.seq_len:,.0f} tokens/s, {_gb(best.memory.peak)} GB per GPU",
              f"  {command}", *(f"  note: {n}" for n in notes), "why the others lost:"]
    lines += [f"  {why_lost(r, best, target)}" for r in ranked[1:]]
    lines += [f"  {line}" for line in left_out]
    return "\n".join(lines)
