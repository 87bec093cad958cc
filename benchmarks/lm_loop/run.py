"""scaleloop against a hand-written nanoGPT-style loop (``handwritten.py``), interleaved, at 1 and 2
processes (issue 29 point 9).

    PYTHONPATH=src python benchmarks/lm_loop/run.py OUT_DIR [--steps 300] [--repeats 3]

The same model (TinyGPT, 2 layers, 128 wide, block 64), batch 16, AdamW (betas 0.9, 0.95, weight
decay 0.1 on the 2-D tensors), warm-up 30 steps and cosine to 1e-4, clipping at 1.0, on the same
token file (this repository's docs, one token per byte). Each repetition runs both loops at both
world sizes, alternating which goes first. ms per step is timed from the end of step 10 to the
last step in both (scaleloop: from its metrics.csv rows, --log-every 10); the validation loss is
over 256 windows of val.bin (the hand-written loop: the first 256; scaleloop: --eval-batches
16, a seeded sample of 256). Prints a Markdown table of medians.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def make_token_files(directory: Path) -> int:
    text = b"".join(p.read_bytes() for p in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                                                   *(ROOT / "src" / "scaleloop").rglob("*.py")]))
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    cut = int(len(tokens) * 0.9)
    tokens[:cut].tofile(directory / "train.bin")
    tokens[cut:].tofile(directory / "val.bin")
    return len(tokens)


def launcher(world: int) -> list[str]:
    return [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node", str(world)]


def handwritten(data: Path, world: int, steps: int) -> dict:
    out = subprocess.run([*launcher(world), str(HERE / "handwritten.py"), str(data), "--steps", str(steps)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def scaleloop(data: Path, world: int, steps: int, work: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=work))
    subprocess.run([sys.executable, "-m", "scaleloop", "train", "--data", "tokenfile", "--data-dir", str(data),
                    "--model", "tinygpt", "--seq-len", "64", "--batch-size", "16", "--optimizer", "adamw",
                    "--lr", "1e-3", "--betas", "0.9,0.95", "--weight-decay", "0.1", "--clip-grad", "1.0",
                    "--lr-schedule", "cosine", "--warmup-steps", "30", "--min-lr", "1e-4", "--max-steps", str(steps),
                    "--eval-batches", "16", "--log-every", "10", "--no-progress", "--no-checkpoints",
                    "--no-tensorboard", "--nproc", str(world), "--out", str(run_dir)],
                   capture_output=True, text=True, check=True)
    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    steps_rows = [r for r in rows if r["kind"] == "step"]
    first, last = steps_rows[0], steps_rows[-1]
    ms = 1000 * (float(last["wall_s"]) - float(first["wall_s"])) / (int(last["step"]) - int(first["step"]))
    test = [r for r in rows if r["kind"] in ("epoch", "stop") and r["test_loss"]]
    return {"loop": "scaleloop", "world": world, "ms_per_step": ms, "val_loss": float(test[-1]["test_loss"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data"
    data.mkdir(exist_ok=True)
    n = make_token_files(data)
    print(f"token file: {n:,} byte tokens ({int(n * 0.9):,} train)", flush=True)
    results = []
    for rep in range(args.repeats):
        for world in (1, 2):
            order = (handwritten, scaleloop) if rep % 2 == 0 else (scaleloop, handwritten)
            for fn in order:
                r = fn(data, world, args.steps) if fn is handwritten else fn(data, world, args.steps, args.out)
                r["repeat"] = rep
                results.append(r)
                print(json.dumps(r), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print("| processes | hand-written ms/step | scaleloop ms/step | ratio (median of pairs) | val loss hand-written | val loss scaleloop |")
    print("| --- | --- | --- | --- | --- | --- |")
    for world in (1, 2):
        hand = [r for r in results if r["world"] == world and r["loop"] == "handwritten"]
        ours = [r for r in results if r["world"] == world and r["loop"] == "scaleloop"]
        ratios = [o["ms_per_step"] / h["ms_per_step"] for h, o in zip(hand, ours)]
        print(f"| {world} | {statistics.median(r['ms_per_step'] for r in hand):.2f} | "
              f"{statistics.median(r['ms_per_step'] for r in ours):.2f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f} - {max(ratios):.3f}) | {statistics.median(r['val_loss'] for r in hand):.4f} | "
              f"{statistics.median(r['val_loss'] for r in ours):.4f} |")


if __name__ == "__main__":
    main()
