"""scaleloop against its peers: the same training with a raw PyTorch loop, scaleloop,
HuggingFace Accelerate and Lightning Fabric, in interleaved repetitions.

    # one process, one thread each (the default):
    /work/peers-venv/bin/python benchmarks/peers/run.py
    # two processes under torchrun (DDP on Gloo), one thread each:
    /work/peers-venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/peers/run.py --ddp

Every framework trains the same model on the same data with the same batch, optimizer,
seed and number of steps, used the way its documentation shows for a CPU run:

- raw:        the tutorial's loop: ``torch.utils.data.DataLoader(TensorDataset, shuffle=True)``,
              ``loss.backward()``, ``optimizer.step()`` (with DDP and a DistributedSampler under --ddp);
- raw-gather: the same loop, batches gathered from the in-memory tensors with an index
              (``x[idx]``) instead of a DataLoader: what scaleloop's loader does for a
              ``TensorDataset``, written by hand. It says how much of any gap is the data path;
- scaleloop:  ``sl.strategy("single"|"ddp", env)``, ``strategy.setup``, ``strategy.loader``,
              ``strategy.accumulate``/``backward``/``optimizer_step`` (as examples/00_single.py);
- accelerate: ``Accelerator(cpu=True)``, ``accelerator.prepare(model, optimizer, dataloader)``,
              ``accelerator.backward(loss)``;
- fabric:     ``Fabric(accelerator="cpu", devices=N, strategy="auto"|"ddp")``, ``fabric.launch()``,
              ``fabric.setup(model, optimizer)``, ``fabric.setup_dataloaders(dataloader)``,
              ``fabric.backward(loss)``.

Each run builds everything afresh (untimed), runs ``--warmup`` steps (untimed), then times
``--steps`` optimizer steps: fetching the batches, forward, backward, step. The frameworks'
order rotates from one repetition to the next, so that a slow moment of a shared machine
hits each of them alike. One torch thread per process everywhere (``--threads``).

Results: ``<out>/<date>_<hardware>_peers[-ddp2][-quick].{md,json}`` (``scaleloop bench index``
lists them). Accelerate and Lightning are not dependencies of scaleloop: install them only in
the benchmark's own environment (benchmarks/peers/requirements.txt; see benchmarks/README.md).
A framework that is not installed stays in the table as "not installed".
"""
from __future__ import annotations

import os

# Before torch starts its thread pools: the intra-op count is set again below, but the
# OpenMP pool and torchrun's warning read this variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Iterator, Optional  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import scaleloop as sl  # noqa: E402
from scaleloop.bench.hardware import describe_hardware, hardware_slug  # noqa: E402
from scaleloop.bench.report import BenchReport, Column, Table, fmt_rate, write_report  # noqa: E402
from scaleloop.bench.stats import summarize  # noqa: E402

FRAMEWORKS = ("raw", "raw-gather", "scaleloop", "accelerate", "fabric")
LABELS = {
    "raw": "raw PyTorch (DataLoader)",
    "raw-gather": "raw PyTorch (in-memory gather)",
    "scaleloop": "scaleloop",
    "accelerate": "HuggingFace Accelerate",
    "fabric": "Lightning Fabric",
}
SEED = 0
LR = 1e-3


@dataclass(frozen=True)
class Workload:
    key: str
    description: str
    batch: int          # per process
    warmup: int         # untimed steps of each run
    steps: int          # timed optimizer steps of each run


WORKLOADS = {
    # Steps: a run of a second or more, so that a moment of other load on a shared machine
    # moves a repetition less.
    "tutorial": Workload("tutorial", "SimpleNet (20 -> 64 -> 1) on RandomDataset 10,000 x 20, BCEWithLogitsLoss, "
                                     "Adam lr 1e-3", batch=128, warmup=20, steps=1200),
    "digits": Workload("digits", "ConvNet (width 32, BatchNorm) on scikit-learn digits (1,797 images 1x8x8), "
                                 "CrossEntropyLoss, Adam lr 1e-3", batch=64, warmup=10, steps=300),
}


def build(workload: Workload) -> tuple[TensorDataset, nn.Module, nn.Module]:
    """The dataset, a freshly initialised model (seeded) and the loss: identical in every run."""
    if workload.key == "tutorial":
        dataset: TensorDataset = sl.RandomDataset(10_000, input_dim=20, generator=torch.Generator().manual_seed(SEED))
        torch.manual_seed(SEED)
        return dataset, sl.SimpleNet(input_dim=20, hidden_dim=64, output_dim=1), nn.BCEWithLogitsLoss()
    data = sl.build_datasets("digits", test_fraction=0.0, seed=SEED)
    torch.manual_seed(SEED)
    return data.train, sl.ConvNet(1, 10, (8, 8)), nn.CrossEntropyLoss()


# --- the frameworks ---------------------------------------------------------------------------
# Each set-up function returns a Trainer: an endless stream of batches and one optimizer step.


@dataclass
class Trainer:
    batches: Iterator[Any]
    step: Callable[[Any], torch.Tensor]      # one optimizer step on a batch; returns the loss
    model: nn.Module

    def run(self, steps: int) -> tuple[torch.Tensor, int]:
        """``steps`` optimizer steps; the last loss and the samples this process trained on."""
        loss, samples = torch.zeros(()), 0
        for _ in range(steps):
            batch = next(self.batches)
            samples += len(batch[0])
            loss = self.step(batch)
        return loss.detach(), samples


def _epochs(loader: Any, set_epoch: Optional[Callable[[int], None]] = None) -> Iterator[Any]:
    epoch = 0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1


def _dataloader(dataset: TensorDataset, batch: int, sampler: Any = None) -> DataLoader:
    return DataLoader(dataset, batch_size=batch, shuffle=sampler is None, sampler=sampler, drop_last=True,
                      generator=torch.Generator().manual_seed(SEED))


def setup_raw(workload: Workload, ddp: bool) -> Trainer:
    dataset, model, criterion = build(workload)
    sampler = None
    if ddp:
        from torch.utils.data.distributed import DistributedSampler

        model = nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, shuffle=True, seed=SEED, drop_last=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loader = _dataloader(dataset, workload.batch, sampler)

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return Trainer(_epochs(loader, sampler.set_epoch if sampler is not None else None), step, model)


def setup_raw_gather(workload: Workload, ddp: bool) -> Trainer:
    dataset, model, criterion = build(workload)
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    x_all, y_all = dataset.tensors
    per_epoch = len(x_all) // (workload.batch * world)

    def batches() -> Iterator[Any]:
        epoch = 0
        while True:
            order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(SEED + epoch))
            mine = order[rank::world]
            for i in range(per_epoch):
                idx = mine[i * workload.batch:(i + 1) * workload.batch]
                yield x_all[idx], y_all[idx]
            epoch += 1

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return Trainer(batches(), step, model)


def setup_scaleloop(workload: Workload, ddp: bool) -> Trainer:
    dataset, model, criterion = build(workload)
    env = sl.DistEnv.from_env(device="cpu")
    strategy = sl.strategy("ddp" if ddp else "single", env)
    model, optimizer = strategy.setup(model, lambda params: torch.optim.Adam(params, lr=LR))
    # scaleloop's batch_size is the GLOBAL batch: the same per-process batch as the others.
    loader = strategy.loader(dataset, batch_size=workload.batch * env.world_size, shuffle=True, seed=SEED,
                             drop_last=True)

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        with strategy.micro_step(model, batch):
            loss = criterion(model(x), y)
            strategy.backward(loss, batch)
        strategy.optimizer_step(optimizer)
        return loss

    return Trainer(_epochs(loader, loader.set_epoch), step, model)


def setup_accelerate(workload: Workload, ddp: bool) -> Trainer:
    from accelerate import Accelerator

    dataset, model, criterion = build(workload)
    accelerator = Accelerator(cpu=True)   # under torchrun it sees the process group: DDP on the CPU
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    # Accelerate shards a plain DataLoader over the processes itself (batch_size per process).
    model, optimizer, loader = accelerator.prepare(model, optimizer, _dataloader(dataset, workload.batch))

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        return loss

    return Trainer(_epochs(loader), step, model)


def setup_fabric(workload: Workload, ddp: bool) -> Trainer:
    from lightning.fabric import Fabric

    world = dist.get_world_size() if ddp else 1
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if ddp else "auto", precision="32-true")
    fabric.launch()   # under torchrun: joins the existing processes, starts none
    dataset, model, criterion = build(workload)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    # Fabric adds a DistributedSampler (and calls its set_epoch) when there are several processes.
    loader = fabric.setup_dataloaders(_dataloader(dataset, workload.batch))

    def step(batch: Any) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        return loss

    return Trainer(_epochs(loader), step, model)


SETUPS: dict[str, Callable[[Workload, bool], Trainer]] = {
    "raw": setup_raw, "raw-gather": setup_raw_gather, "scaleloop": setup_scaleloop,
    "accelerate": setup_accelerate, "fabric": setup_fabric,
}
PACKAGES = {"accelerate": "accelerate", "fabric": "lightning"}


def version_of(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def available(framework: str) -> Optional[str]:
    """None if ``framework`` can run here, else why not."""
    package = PACKAGES.get(framework)
    if package is None:
        return None
    try:
        __import__("lightning.fabric" if package == "lightning" else package)
    except ImportError:
        return f"not installed ({package}; see benchmarks/peers/requirements.txt)"
    return None


# --- measuring --------------------------------------------------------------------------------


def _barrier(ddp: bool) -> None:
    if ddp:
        dist.barrier()


def measure(framework: str, workload: Workload, ddp: bool, threads: int) -> dict[str, Any]:
    """Set up (untimed), warm up (untimed), then time ``workload.steps`` steps of one framework."""
    trainer = SETUPS[framework](workload, ddp)
    torch.set_num_threads(threads)   # the same for all, whatever a framework's set-up did
    trainer.run(workload.warmup)
    gc.collect()
    _barrier(ddp)
    start, cpu_start = time.perf_counter(), time.process_time()
    loss, samples = trainer.run(workload.steps)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    state = {k: v.detach().clone() for k, v in _inner(trainer.model).state_dict().items()}
    # CPU seconds of this process (all its threads) per step: the work done, which another
    # process's load on a shared machine changes far less than the wall time.
    result = {"elapsed_s": elapsed, "samples": samples, "loss": float(loss), "threads": torch.get_num_threads(),
              "wrapper": _wrappers(trainer.model), "cpu_ms_per_step": 1e3 * cpu / workload.steps}
    if ddp:
        # The slowest rank decides when the step is over for all; samples count every rank's.
        ranks: list[Any] = [None] * dist.get_world_size()
        # Parameters only: BatchNorm's running statistics are each rank's own until DDP broadcasts
        # rank 0's at the next forward.
        checksum = float(sum(p.detach().double().sum() for p in _inner(trainer.model).parameters()))
        dist.all_gather_object(ranks, (elapsed, samples, checksum, result["cpu_ms_per_step"]))
        result.update(elapsed_s=max(r[0] for r in ranks), samples=sum(r[1] for r in ranks),
                      ranks_agree=len({r[2] for r in ranks}) == 1,    # DDP kept the replicas identical
                      cpu_ms_per_step=statistics.fmean(r[3] for r in ranks))   # per process
    result["samples_per_s"] = result["samples"] / result["elapsed_s"]
    result["state"] = state
    return result


def _inner(model: nn.Module) -> nn.Module:
    """The user's module inside Fabric's and DDP's wrappers."""
    model = getattr(model, "_forward_module", model)   # Fabric's _FabricModule
    return getattr(model, "module", model)              # DistributedDataParallel


def _wrappers(model: nn.Module) -> str:
    """What the framework wrapped the model in, outermost first: proof of DDP under --ddp."""
    names = [type(model).__name__]
    for attr in ("_forward_module", "module"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module):
            model = inner
            names.append(type(model).__name__)
    return " > ".join(names)


def rotate(items: tuple[str, ...], k: int) -> list[str]:
    k %= len(items)
    return list(items[k:] + items[:k])


def quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def run_workload(workload: Workload, frameworks: list[str], repeats: int, ddp: bool, threads: int,
                 say: Callable[[str], None]) -> dict[str, Any]:
    """Interleaved repetitions of every framework on one workload; per-framework summaries."""
    runnable = [f for f in frameworks if available(f) is None]
    say(f"{workload.key}: warm-up repetition (not counted)")
    for fw in runnable:
        measure(fw, workload, ddp, threads)
    reps: list[dict[str, Any]] = []
    weights_vs_raw: dict[str, float] = {}
    for i in range(repeats):
        order = rotate(tuple(runnable), i)
        rep: dict[str, Any] = {"repetition": i + 1, "order": order}
        states: dict[str, Any] = {}
        for fw in order:
            result = measure(fw, workload, ddp, threads)
            states[fw] = result.pop("state")
            rep[fw] = result
        if i == 0 and "raw" in states:
            # Same seed, same DataLoader order: the DataLoader-fed frameworks should end with the
            # raw loop's weights (scaleloop and raw-gather shuffle in their own order).
            for fw, state in states.items():
                if fw in ("raw", "raw-gather", "scaleloop"):
                    continue
                weights_vs_raw[fw] = max(float((state[k].float() - states["raw"][k].float()).abs().max())
                                         for k in states["raw"])
        reps.append(rep)
        say(f"{workload.key}: repetition {i + 1}/{repeats}: " + ", ".join(
            f"{fw} {rep[fw]['samples_per_s']:,.0f}/s" for fw in runnable))

    base = [r["raw"]["samples_per_s"] for r in reps] if "raw" in runnable else None
    rows = []
    for fw in frameworks:
        why = available(fw)
        if why is not None:
            rows.append({"framework": LABELS[fw], "key": fw, "note": why})
            continue
        rates = [r[fw]["samples_per_s"] for r in reps]
        s = summarize(rates)
        q1, q3 = quartiles(rates)
        row = {"framework": LABELS[fw], "key": fw, "median": s["median"], "min": s["min"], "max": s["max"],
               "q1": q1, "q3": q3, "spread": s["spread"], "rates": rates,
               "ms_per_step": 1e3 * workload.batch * (dist.get_world_size() if ddp else 1) / s["median"],
               "loss_last": statistics.median(r[fw]["loss"] for r in reps),
               "threads": sorted({r[fw]["threads"] for r in reps}), "wrapper": reps[0][fw]["wrapper"],
               "samples_per_run": reps[0][fw]["samples"]}
        if ddp:
            row["ranks_agree"] = all(r[fw]["ranks_agree"] for r in reps)
        cpu = [r[fw]["cpu_ms_per_step"] for r in reps]
        row.update(cpu_ms_per_step=statistics.median(cpu), cpu_ms_min=min(cpu), cpu_ms_max=max(cpu))
        if base is not None:
            per_rep = [a / b for a, b in zip(rates, base)]
            row.update(ratio=s["median"] / statistics.median(base), ratio_min=min(per_rep), ratio_max=max(per_rep))
            base_cpu = statistics.median(r["raw"]["cpu_ms_per_step"] for r in reps)
            row["cpu_ratio"] = base_cpu / row["cpu_ms_per_step"]   # above 1: less CPU per step than raw
        if fw in weights_vs_raw:
            row["weights_vs_raw"] = weights_vs_raw[fw]
        rows.append(row)
    return {"workload": asdict(workload), "rows": rows, "repetitions": reps}


# --- the report -------------------------------------------------------------------------------


def _fmt_ratio_range(row: dict[str, Any]) -> str:
    return f"{row['ratio_min']:.2f} - {row['ratio_max']:.2f}" if "ratio_min" in row else "-"


def make_report(results: list[dict[str, Any]], args: argparse.Namespace, hw: dict[str, Any],
                load_start: Optional[list[float]], load_end: Optional[list[float]], world: int,
                versions: Optional[dict[str, Any]] = None) -> BenchReport:
    tables = []
    for res in results:
        wl = res["workload"]
        rows = [dict(r, range=_fmt_ratio_range(r), iqr=(f"{fmt_rate(r['q1'])} - {fmt_rate(r['q3'])}"
                                                         if "q1" in r else None),
                     cpu=(f"{r['cpu_ms_per_step']:.2f} ({r['cpu_ms_min']:.2f} - {r['cpu_ms_max']:.2f})"
                          if "cpu_ms_per_step" in r else None))
                for r in res["rows"]]
        tables.append(Table(f"{wl['key']}: {wl['description']}, batch {wl['batch']} per process", [
            Column("framework", "framework"),
            Column("median", "samples/s (median)", fmt_rate),
            Column("iqr", "IQR"),
            Column("min", "min", fmt_rate), Column("max", "max", fmt_rate),
            Column("ratio", "median / raw", lambda v: f"{v:.2f}"),
            Column("range", "per-repetition ratio to raw"),
            Column("ms_per_step", "ms / step", lambda v: f"{v:.2f}"),
            Column("cpu", "CPU ms / step (min - max)"),
            Column("cpu_ratio", "raw's CPU / its CPU", lambda v: f"{v:.2f}"),
            Column("note", "note")], rows,
            f"{args.repeats} interleaved repetitions (order rotated each time), each {wl['warmup']} untimed + "
            f"{wl['steps']} timed optimizer steps, {world} process(es) x {args.threads} thread(s). "
            "'median / raw': median samples/s over the raw DataLoader loop's median; above 1 is faster than raw. "
            "'CPU ms / step': CPU time of the process (all its threads) per step, median (min - max): it leaves "
            "out time spent waiting for a core, so other processes move it less than wall time (contention for "
            "caches and memory still moves it). "
            "'raw's CPU / its CPU': above 1 means less CPU per step than the raw loop."))
    versions = versions or {"torch": torch.__version__, "accelerate": version_of("accelerate"),
                "lightning": version_of("lightning"), "scaleloop": sl.__version__}
    what = "peers"
    title = (f"Peers: raw PyTorch vs scaleloop vs Accelerate vs Fabric, {world} process(es) x {args.threads} "
             f"thread(s) on the CPU")
    report = BenchReport(
        what=what, title=title, hardware=hw, slug=hardware_slug(hw, "cpu"),
        command=" ".join(["python", "benchmarks/peers/run.py", *sys.argv[1:]]) if world == 1 else
        f"python -m torch.distributed.run --standalone --nproc-per-node {world} benchmarks/peers/run.py "
        + " ".join(sys.argv[1:]),
        settings={"frameworks": args.frameworks.split(","), "repeats": args.repeats, "threads": args.threads,
                  "processes": world, "ddp": bool(args.ddp), "versions": versions,
                  "workloads": [r["workload"] for r in results]},
        tables=tables, quick=args.quick, tag=("ddp%d" % world) if args.ddp else "",
        data={"results": results, "load_average_start": load_start, "load_average_end": load_end,
              "versions": versions, "python": platform.python_version()})
    report.headline = "; ".join(_headline(res) for res in results)
    report.notes = _notes(results, versions, load_start, load_end, world)
    return report


def _scaleloop_notes(res: dict[str, Any], key: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    """scaleloop against every other row, by wall time and by CPU time; where it is not faster."""
    sl = rows["scaleloop"]
    others = [k for k, r in rows.items() if k != "scaleloop" and "median" in r]
    faster, slower, unclear = [], [], []
    parts = []
    for k in others:
        ratios = [r["scaleloop"]["samples_per_s"] / r[k]["samples_per_s"] for r in res["repetitions"]]
        cpu = rows[k]["cpu_ms_per_step"] / sl["cpu_ms_per_step"]
        parts.append(f"{LABELS[k]} {sl['median'] / rows[k]['median']:.2f}x (per repetition {min(ratios):.2f} - "
                     f"{max(ratios):.2f}; by CPU time per step {cpu:.2f}x)")
        # Faster only if it was so in every repetition, side by side, and by CPU time too.
        (faster if min(ratios) > 1 and cpu > 1 else slower if max(ratios) < 1 else unclear).append(LABELS[k])
    notes = [f"{key}: scaleloop's samples/s over each other row's (above 1: scaleloop faster): " + "; ".join(parts)
             + "."]
    verdict = []
    if faster:
        verdict.append(f"faster in every repetition and by CPU time than {', '.join(faster)}")
    if slower:
        verdict.append(f"SLOWER in every repetition than {', '.join(slower)}")
    if unclear:
        verdict.append(f"NOT clearly faster than {', '.join(unclear)} (the per-repetition ratios lie on both "
                       "sides of 1: within this machine's noise)")
    notes.append(f"{key}: scaleloop is " + "; ".join(verdict) + ".")
    if LABELS["raw-gather"] in unclear and faster:
        notes.append(f"{key}: scaleloop's loader gathers a TensorDataset's batches with one index per tensor, as "
                     "the raw-gather loop does by hand, instead of a DataLoader's sample-by-sample fetch and "
                     "collate; scaleloop is within noise of that loop, so its lead over the DataLoader rows is "
                     "that data path, not the rest of its loop.")
    return notes


def _pair_range(res: dict[str, Any], a: str, b: str) -> str:
    """min - max over the repetitions of a's samples/s over b's, measured side by side."""
    ratios = [r[a]["samples_per_s"] / r[b]["samples_per_s"] for r in res["repetitions"]]
    return f"{min(ratios):.2f} - {max(ratios):.2f}"


def _headline(res: dict[str, Any]) -> str:
    parts = [f"{r['key']} {r['ratio']:.2f}x (CPU {r['cpu_ratio']:.2f}x)" for r in res["rows"]
             if "ratio" in r and r["key"] != "raw"]
    return f"{res['workload']['key']}: samples/s vs raw DataLoader loop (and by CPU time per step): " + ", ".join(parts)


def _notes(results: list[dict[str, Any]], versions: dict[str, Any], load_start: Optional[list[float]],
           load_end: Optional[list[float]], world: int) -> list[str]:
    notes = ["Versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()) + "."]
    if load_start:
        notes.append("Load average (1, 5, 15 min) at the start: " + ", ".join(f"{v:.2f}" for v in load_start)
                     + (("; at the end: " + ", ".join(f"{v:.2f}" for v in load_end)) if load_end else "")
                     + ". The machine is shared; the interleaving spreads other processes' load over all rows, "
                       "the IQR and min/max show how much it moved them.")
    for res in results:
        key = res["workload"]["key"]
        rows = {r["key"]: r for r in res["rows"]}
        for fw in ("accelerate", "fabric"):
            r = rows.get(fw, {})
            if "weights_vs_raw" in r and r["weights_vs_raw"] <= 1e-5:
                notes.append(f"{key}: {LABELS[fw]} ends with the raw loop's weights to within "
                             f"{r['weights_vs_raw']:.1e} (same seed, same DataLoader order): the same work.")
            elif "weights_vs_raw" in r:
                notes.append(f"{key}: {LABELS[fw]} ends with weights up to {r['weights_vs_raw']:.1e} away from the "
                             "raw loop's: the same number of steps and samples, but its batches come in another "
                             "order (it shards the DataLoader over the processes its own way).")
        sl_row = rows.get("scaleloop")
        if sl_row and "median" in sl_row:
            notes.extend(_scaleloop_notes(res, key, rows))
    for res in results:
        wrappers = {r["key"]: r["wrapper"] for r in res["rows"] if "wrapper" in r}
        notes.append(f"{res['workload']['key']}: the model as each framework wrapped it: "
                     + "; ".join(f"{k}: {v}" for k, v in wrappers.items()) + ".")
        if world > 1:
            agree = [r["key"] for r in res["rows"] if r.get("ranks_agree") is False]
            notes.append(f"{res['workload']['key']}: " + (
                "every framework ended with identical parameters on every process (DDP synchronised them)."
                if not agree else f"parameters DIFFER between processes for: {', '.join(agree)}."))
    if world > 1:
        notes.append(f"{world} processes under torchrun, Gloo, DDP in every framework; samples/s counts all "
                     "processes; the slowest process's time is used.")
    return notes


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="tutorial,digits", help="comma-separated: tutorial, digits")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated: " + ", ".join(FRAMEWORKS))
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions of each framework (default 10)")
    parser.add_argument("--steps", type=int, help="timed steps per run (default: per workload)")
    parser.add_argument("--warmup", type=int, help="untimed steps per run (default: per workload)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--ddp", action="store_true", help="run under torchrun: DDP in every framework")
    parser.add_argument("--quick", action="store_true", help="a few steps and repetitions (a smoke test)")
    parser.add_argument("--out", default="benchmarks", help="directory for the .md and .json (default benchmarks)")
    parser.add_argument("--render", metavar="JSON",
                        help="measure nothing: write the tables and notes again from a result's JSON")
    args = parser.parse_args(argv)
    if args.render:
        return render(Path(args.render), Path(args.out))

    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = [f for f in frameworks if f not in FRAMEWORKS]
    keys = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in keys if w not in WORKLOADS]
    if unknown or bad or not frameworks or not keys:
        parser.error(f"unknown framework(s) {unknown} or workload(s) {bad}; choose from {FRAMEWORKS} and "
                     f"{tuple(WORKLOADS)}")
    if args.quick:
        args.repeats = min(args.repeats, 2)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be positive")

    torch.set_num_threads(args.threads)
    ddp = bool(args.ddp)
    if ddp:
        if "RANK" not in os.environ:
            parser.error("--ddp runs under torchrun: python -m torch.distributed.run --standalone "
                         "--nproc-per-node 2 benchmarks/peers/run.py --ddp")
        # One Gloo group for the whole benchmark; Accelerate, Fabric and scaleloop each see that
        # it exists and use it instead of starting their own.
        dist.init_process_group("gloo")
    world = dist.get_world_size() if ddp else 1
    main_rank = not ddp or dist.get_rank() == 0
    say = (lambda m: print(f"peers: {m}", file=sys.stderr, flush=True)) if main_rank else (lambda _m: None)

    hw = describe_hardware()
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    results = []
    for key in keys:
        wl = WORKLOADS[key]
        steps = args.steps or (10 if args.quick else wl.steps)
        warmup = args.warmup if args.warmup is not None else (2 if args.quick else wl.warmup)
        wl = Workload(wl.key, wl.description, wl.batch, warmup, steps)
        results.append(run_workload(wl, frameworks, args.repeats, ddp, args.threads, say))
    load_end = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    if main_rank:
        report = make_report(results, args, hw, load_start, load_end, world)
        paths = write_report(report, Path(args.out))
        print(report.terminal())
        print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    if ddp:
        dist.destroy_process_group()
    return 0


def render(path: Path, out: Path) -> int:
    """The report of a saved result, rebuilt with this version's tables and notes (same measurements)."""
    saved = json.loads(path.read_text(encoding="utf-8"))
    st, data = saved["settings"], saved["data"]
    args = argparse.Namespace(repeats=st["repeats"], threads=st["threads"], frameworks=",".join(st["frameworks"]),
                              ddp=st["ddp"], quick=saved["quick"])
    report = make_report(data["results"], args, saved["hardware"], data["load_average_start"],
                         data["load_average_end"], st["processes"], versions=st["versions"])
    report.command, report.date = saved["command"], saved["date"]
    paths = write_report(report, out)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
