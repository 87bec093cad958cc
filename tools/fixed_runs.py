"""Record, or check bitwise, the final weights of fixed small runs (a refactor changes no result).

    python tools/fixed_runs.py record DIGESTS.json   # before a change
    python tools/fixed_runs.py check DIGESTS.json    # after it: every tensor of every run equal

Each run is started as a user starts it (``scaleloop train``), on the CPU, and its ``model.pt``
is read tensor by tensor; the digest is sha256 over the tensors' bytes, names and dtypes.
The runs: the 13 of issue 26 (tinygpt on tokens, 6 steps, clip 0.5, batch 16) and digits under
single, ddp and allreduce.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TINY = ["--model", "tinygpt", "--data", "tokens", "--n-samples", "256", "--max-steps", "6",
        "--clip-grad", "0.5", "--batch-size", "16", "--seq-len", "32"]
DIGITS = ["--epochs", "1", "--max-steps", "12"]
RUNS: dict[str, list[str]] = {
    "single": TINY + ["--strategy", "single"],
    "ddp": TINY + ["--strategy", "ddp", "--nproc", "2"],
    "fsdp": TINY + ["--strategy", "fsdp", "--nproc", "2"],
    "fsdp-ac": TINY + ["--strategy", "fsdp", "--nproc", "2", "--activation-checkpointing"],
    "pipeline-gpipe": TINY + ["--strategy", "pipeline", "--nproc", "2", "--microbatches", "2"],
    "pipeline-1f1b": TINY + ["--strategy", "pipeline", "--nproc", "2", "--microbatches", "2",
                             "--pipeline-schedule", "1f1b"],
    "mesh-pp2-dp2": TINY + ["--mesh", "pp=2,dp=2", "--nproc", "4", "--microbatches", "2"],
    "mesh-fsdp2-tp2": TINY + ["--mesh", "fsdp=2,tp=2", "--nproc", "4"],
    "mesh-dp2-tp2": TINY + ["--mesh", "dp=2,tp=2", "--nproc", "4"],
    "mesh-dp2-fsdp2": TINY + ["--mesh", "dp=2,fsdp=2", "--nproc", "4"],
    "mesh-tp2-ac": TINY + ["--mesh", "tp=2", "--nproc", "2", "--activation-checkpointing"],
    "mesh-fsdp2": TINY + ["--mesh", "fsdp=2", "--nproc", "2"],
    "digits-fsdp": DIGITS + ["--strategy", "fsdp", "--nproc", "2"],
    "digits-single": DIGITS + ["--strategy", "single"],
    "digits-ddp": DIGITS + ["--strategy", "ddp", "--nproc", "2"],
    "digits-allreduce": DIGITS + ["--strategy", "allreduce", "--nproc", "2"],
}


def digest(model_pt: Path) -> str:
    import torch
    state = torch.load(model_pt, map_location="cpu", weights_only=False)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_all(only: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in RUNS.items():
            if only and name not in only:
                continue
            run_dir = Path(tmp) / name
            cmd = ["scaleloop", "train", *args, "--device", "cpu", "--out", str(run_dir),
                   "--no-progress", "--tracker", "none", "--timeout", "120"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise SystemExit(f"{name}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            out[name] = digest(run_dir / "model.pt")
            print(f"{name}: {out[name][:16]}", flush=True)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("record", "check"):
        print(__doc__.strip().splitlines()[0] + "\nusage: fixed_runs.py record|check DIGESTS.json [RUN...]")
        return 2
    mode, path, only = argv[0], Path(argv[1]), argv[2:]
    got = run_all(only)
    if mode == "record":
        path.write_text(json.dumps(got, indent=1) + "\n")
        return 0
    want = json.loads(path.read_text())
    bad = [name for name in got if want.get(name) != got[name]]
    for name in got:
        print(f"{name}: {'equal' if name not in bad else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
