"""scaleloop's per-step overhead counted in CPU instructions, which a busy machine cannot blur.

    python benchmarks/instructions/run.py                      # SimpleNet (tutorial workload)
    python benchmarks/instructions/run.py --model convnet      # ConvNet on the 8x8 digits

Wall-clock ratios on a shared 2-core machine move by several percent from one repetition to
the next; a 1-2% overhead cannot be resolved that way. Instructions executed can: this script
runs itself under ``valgrind --tool=callgrind`` (valgrind must be installed) and counts the
instructions of the same steady-state training steps of

- the raw loop (``scaleloop.bench.rawloop``, data path ``gather``: the tutorial's loop with
  batches gathered by ``index_select``, the same data path as scaleloop's), and
- ``scaleloop.loop.training.train`` (``scaleloop train``'s loop),

both in one process, in the order raw, scaleloop, raw, scaleloop, after one untimed warm-up run
of each. The counted span starts at the forward pass of optimizer step 10 and ends at that of
step 70 (SimpleNet; steps 5 to 20 for ConvNet), so it holds whole steps only: data, forward,
backward, optimizer, scheduler, loss bookkeeping, and scaleloop's log rows (every 10 steps) —
but no set-up, evaluation or epoch end. Marks: a call of ``os.getppid()`` from the loss
function, before which callgrind dumps its counters (``--dump-before=getppid``).

Caveat: instructions are not time. Python's interpreter and small kernels run at a lower
instructions-per-cycle than large matrix products, so a time ratio can be somewhat above the
instruction ratio. The report says both what was counted and how.

Results: ``<out>/<date>_<hardware>_overhead-instructions-<model>.{md,json}``.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "src"))

WORKLOADS = {
    # model: (data, batch, hidden, (first marked step, last marked step))
    "simplenet": ("random", 128, 64, (10, 70)),
    "convnet": ("digits", 64, 128, (5, 20)),
}


def child(model: str) -> None:
    """Runs under valgrind: warm up, then raw, scaleloop, raw, scaleloop with marked steps."""
    import torch

    import scaleloop.loop.training
    import scaleloop.loop.losses
    from scaleloop.bench.rawloop import raw_train
    from scaleloop.config import TrainConfig
    from scaleloop.runtime.dist import DistEnv

    torch.set_num_threads(1)
    data, batch, hidden, marks = WORKLOADS[model]
    cfg = TrainConfig(model=model, data=data, n_samples=10_000, input_dim=20, hidden_dim=hidden, batch_size=batch,
                      epochs=1, optimizer="adam", lr=1e-2, test_fraction=0.0, progress=False, tensorboard=False,
                      checkpoints=False, device="cpu")
    env = DistEnv(device=torch.device("cpu"))
    tmp = tempfile.mkdtemp()
    task_loss = scaleloop.loop.losses.task_loss
    calls = [0]

    def marked(*args):   # the loss of every step, in both loops
        calls[0] += 1
        if calls[0] in marks:
            os.getppid()
        return task_loss(*args)

    # Both loops look it up in scaleloop.loop.losses when they call it (rawloop imports it at
    # run time; the run's loss_fn calls the module's task_loss).
    scaleloop.loop.losses.task_loss = marked
    runs = [0]

    def ours(mark: bool) -> None:
        runs[0] += 1
        calls[0] = 0 if mark else -10**9
        scaleloop.loop.training.train(cfg.replace(out=f"{tmp}/{runs[0]}"), env, log=lambda _m: None)

    def raw(mark: bool) -> None:
        calls[0] = 0 if mark else -10**9
        raw_train(cfg, env.device, "gather")

    ours(False), raw(False)
    os.getppid()
    for _ in range(2):
        raw(True)
        ours(True)


def _counts(path: Path) -> dict[str, int]:
    """Instructions per function (self cost) of one callgrind dump."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(path)],
                         capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+) \([ \d.]+%\)\s+(.*)$", line)
        if m and "PROGRAM TOTALS" not in m.group(2):
            name = re.sub(r"'\d+", "", m.group(2))
            counts[name] = counts.get(name, 0) + int(m.group(1).replace(",", ""))
    return counts


def _total(path: Path) -> int:
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:") or line.startswith("summary:"):
            return int(line.split()[1])
    raise ValueError(f"no totals in {path}")


def _short(name: str) -> str:
    fn = name.split(" [")[0]
    lib = name.rsplit("/", 1)[-1].rstrip("]") if " [" in name else ""
    return f"{fn.split(':', 1)[-1] if ':' in fn else fn} ({lib})" if lib else fn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="simplenet")
    parser.add_argument("--out", default=str(HERE.parents[1]), help="results directory (default: benchmarks)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        print("this benchmark needs valgrind (with callgrind_annotate) on the PATH", file=sys.stderr)
        return 2
    from scaleloop.bench.hardware import describe_hardware, hardware_slug
    from scaleloop.bench.report import BenchReport, Column, Table, write_report

    hw = describe_hardware()
    data, batch, hidden, marks = WORKLOADS[args.model]
    steps = marks[1] - marks[0]
    with tempfile.TemporaryDirectory(prefix="scaleloop-callgrind-") as tmp:
        dump = Path(tmp) / "cg.out"
        print("running under valgrind (minutes: importing torch alone takes 1-3 of them) ...", file=sys.stderr)
        subprocess.run(["valgrind", "--tool=callgrind", "--dump-before=getppid", f"--callgrind-out-file={dump}",
                        sys.executable, str(HERE), "--child", "--model", args.model],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Dumps: .1 set-up, .2 up to raw's first mark, .3 raw's marked steps, .4 up to scaleloop's
        # first mark, .5 scaleloop's marked steps, then .7 raw and .9 scaleloop again.
        pairs = [(dump.with_name(f"cg.out.{r}"), dump.with_name(f"cg.out.{s}")) for r, s in ((3, 5), (7, 9))]
        totals = [(_total(r), _total(s)) for r, s in pairs]
        raw_f, ours_f = _counts(pairs[0][0]), _counts(pairs[0][1])
    rows = []
    for i, (r, s) in enumerate(totals, 1):
        rows.append({"pass": i, "raw_per_step": r / steps, "scaleloop_per_step": s / steps,
                     "extra_per_step": (s - r) / steps, "ratio": s / r})
    skip = ("(below main)", "libc-start", "python.c:main", "Py_BytesMain", "Py_RunMain", "pythonrun", "0x0000",
            "PyEval_EvalCode")
    names = [n for n in set(raw_f) | set(ours_f) if not any(k in n for k in skip)]
    diffs = sorted(names, key=lambda n: ours_f.get(n, 0) - raw_f.get(n, 0), reverse=True)[:12]
    where = [{"function": _short(n), "raw_per_step": raw_f.get(n, 0) / steps,
              "scaleloop_per_step": ours_f.get(n, 0) / steps,
              "extra_per_step": (ours_f.get(n, 0) - raw_f.get(n, 0)) / steps} for n in diffs]
    ratio = sum(s for _, s in totals) / sum(r for r, _ in totals)
    fmt_k = lambda v: f"{v / 1e3:,.1f}k"   # noqa: E731
    table = Table("Instructions per training step (callgrind), same steps of each loop", [
        Column("pass", "pass"), Column("raw_per_step", "raw loop", fmt_k),
        Column("scaleloop_per_step", "scaleloop", fmt_k), Column("extra_per_step", "scaleloop - raw", fmt_k),
        Column("ratio", "scaleloop / raw", lambda v: f"{v:.4f}")], rows,
        f"{steps} steady-state optimizer steps per loop and pass (steps {marks[0]}-{marks[1]} of an epoch), "
        f"{args.model} on {data}, batch {batch}, Adam, fp32, one torch thread.")
    top = Table("Where the extra instructions are (first pass, per step)", [
        Column("function", "function (self cost)"), Column("raw_per_step", "raw", fmt_k),
        Column("scaleloop_per_step", "scaleloop", fmt_k), Column("extra_per_step", "extra", fmt_k)], where,
        "The Python interpreter's own loop (_PyEval_EvalFrameDefault) is scaleloop's Python code per step: "
        "sampler plan, Batch, strategy calls, loss bookkeeping, scheduler, a log row every 10 steps.")
    report = BenchReport(
        what="overhead", title=f"Overhead in instructions: scaleloop's loop vs the raw loop, {args.model} on {data}",
        hardware=hw, slug=hardware_slug(hw, "cpu"), command=f"python benchmarks/instructions/run.py --model {args.model}",
        settings={"model": args.model, "data": data, "batch_size": batch, "hidden_dim": hidden, "marked_steps": marks,
                  "tool": "valgrind --tool=callgrind --dump-before=getppid"},
        tables=[table, top], tag=f"instructions-{args.model}",
        data={"ratio": ratio, "passes": rows, "top_functions": where})
    report.headline = (f"scaleloop's loop executes {ratio:.4f}x the instructions of the raw loop per step "
                       f"({(ratio - 1) * 100:.2f}% more; {rows[0]['extra_per_step'] / 1e3:,.1f}k of "
                       f"{rows[0]['raw_per_step'] / 1e6:.2f}M per step)")
    report.notes = [
        "Counted, not timed: the count does not change with the machine's load (the two passes agree to "
        f"{abs(rows[0]['ratio'] - rows[1]['ratio']) * 100:.3f} points).",
        "Instructions are not time: Python code and small kernels run at a lower IPC than matrix products, so "
        "the time ratio on an idle machine can be somewhat higher; the wall-clock benchmark "
        "(scaleloop bench overhead) measures that, with the noise of the machine.",
        "Same data path on both sides (index_select from the in-memory tensors); the same batches, model, seed "
        "and optimizer; GC and allocator effects are included.",
    ]
    paths = write_report(report, Path(args.out))
    print(report.terminal())
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
