"""torchft's checkpoint server as ``--replica-groups`` uses it (``strategies.fault_tolerant``): the
requests it serves (a rejoining group taking a live one's state) go to the rank's log, not the
console; a request it answers with an error is still said on stderr."""
from __future__ import annotations

import io
import sys
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft")
from torchft.checkpointing.http_transport import HTTPTransport  # noqa: E402

from scaleloop.strategies.fault_tolerant import requests_to_log  # noqa: E402

TIMEOUT = timedelta(seconds=30)


class WorkerStderr(io.StringIO):
    """Rank 0's stderr in a worker (``launching.worker``): the console (its value here), and a log."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[str] = []

    def log_only(self, text: str) -> None:
        self.logged.append(text)


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")   # torchft's load (it is torch's)
def test_requests_served_go_to_the_log_and_errors_to_the_console(monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = WorkerStderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    transport: HTTPTransport[dict[str, torch.Tensor]] = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    requests_to_log(transport)
    try:
        transport.send_checkpoint(dst_ranks=[1], step=3, state_dict={"w": torch.ones(2)}, timeout=TIMEOUT)
        taken = transport.recv_checkpoint(src_rank=0, metadata=transport.metadata(), step=3, timeout=TIMEOUT)
        assert torch.equal(taken["w"], torch.ones(2))
        with pytest.raises(urllib.error.HTTPError):   # a step it does not serve: 400
            urllib.request.urlopen(f"{transport.metadata()}4/full", timeout=TIMEOUT.total_seconds())
    finally:
        transport.shutdown()
    [served] = stderr.logged
    assert served.startswith("torchft checkpoint server: ") and '"GET /checkpoint/3/full HTTP/1.1" 200' in served
    console = stderr.getvalue()
    assert "/checkpoint/3/" not in console
    assert "invalid checkpoint requested" in console and '"GET /checkpoint/4/full HTTP/1.1" 400' in console
