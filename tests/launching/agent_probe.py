"""A worker entry (``main(argv)``) that notes what kind of process it runs in, for test_agent."""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch

    rank = int(os.environ["RANK"])
    facts = {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "threads": torch.get_num_threads(),
             "collecting": gc.isenabled(), "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
             "world": int(os.environ["WORLD_SIZE"]), "cmdline": Path("/proc/self/cmdline").read_text()}
    Path(argv[0], f"rank{rank}.json").write_text(json.dumps(facts))
    print(f"rank {rank} says hello", flush=True)
    return int(argv[1]) if rank == 1 and len(argv) > 1 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
