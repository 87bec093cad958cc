"""Model and optimizer state through ``torch.distributed.checkpoint`` (DCP): each rank its own part.

A sharded strategy (FSDP) never holds the whole model on one rank, so its checkpoint is written
by every rank at once: ``get_state_dict`` gives each rank's shards (DTensors) with the model's
own parameter names, and ``dcp.save`` writes one ``__<rank>_0.distcp`` file per rank plus a
``.metadata`` file (rank 0) that records every tensor's global shape and where each piece lies.

Loading is the reverse, on any number of ranks: ``get_state_dict`` gives a template shaped for
*this* run (its own sharding, or plain tensors for a replicated strategy), ``dcp.load`` fills it
from whichever files hold the needed pieces, and ``set_state_dict`` puts it into the model and
optimizer. That is how a checkpoint written by 2 ranks resumes on 1, or on 4,
or one written on a 2x2 ``--mesh`` resumes on another shape.

A tensor-parallel layer split in strided pieces (a fused q/k/v projection) is gathered along
the tensor-parallel dimension for writing and cut again after reading: DCP needs each rank's
piece to be one box of the whole tensor.

Loading never runs code from the files: ``.metadata`` (a plain pickle, which DCP's own reader
unpickles as it is) is read by ``checkpoint.untrusted``'s restricted unpickler, each data file it
names must lie inside the checkpoint directory, and byte entries (the optimizer's hyperparameters)
are read weights-only, as DCP already reads tensors (:func:`_reader`, :func:`_planner`).

Every function here that touches a process group is a collective: every rank calls it.
"""
from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import pickle
import shutil
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as torch_dist
from torch import nn

from scaleloop.checkpoint.background import ShardedSave
from scaleloop.checkpoint.store import CheckpointError
from scaleloop.checkpoint.untrusted import METADATA_FILE, load_metadata

MODEL_KEY = "model"
OPTIMIZER_KEY = "optimizer"
#: ``state.pt``'s marker (and the manifest's) for a checkpoint whose model and optimizer state are
#: in these files beside it rather than in ``state.pt``.
SHARDED_FORMAT = "torch.distributed.checkpoint"


@contextlib.contextmanager
def _quiet_without_group() -> Iterator[None]:
    # Without a process group DCP reads/writes as one process, and warns that it assumes so.
    with warnings.catch_warnings():
        if not (torch_dist.is_available() and torch_dist.is_initialized()):
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _strided(t: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in getattr(t, "placements", ()))


def _portable(obj: Any) -> Any:
    """``obj`` (nested dicts and lists of state) with every DTensor that has a strided placement
    (tensor parallelism's fused q/k/v, ``strategies.tensor``) gathered along those mesh
    dimensions: DCP describes each rank's piece as one box of the whole tensor, and a strided
    piece is several. The other tensors are passed through as they are."""
    if isinstance(obj, dict):
        return {key: _portable(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_portable(value) for value in obj]
    if _strided(obj):
        from torch.distributed.tensor import Replicate

        with gathering_strided_pieces():
            return obj.redistribute(placements=[Replicate() if _strided_one(p) else p for p in obj.placements])
    return obj


#: torch's logger for DTensor redistributions, and the start of its note on a strided gather.
_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
_STRIDED_GATHER_NOTE = "While redistributing from (_StridedShard"


class _NotTheStridedGather(logging.Filter):
    """Passes every record but torch's note that gathering a strided piece takes one all-gather per
    mesh dimension (a cost) and "may give inconsistent results between ranks due to different
    reduction orders" (an all-gather reduces nothing: the gathered tensor is exact)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_STRIDED_GATHER_NOTE)


@contextlib.contextmanager
def gathering_strided_pieces() -> Iterator[None]:
    """While scaleloop gathers strided pieces on purpose (a checkpoint's :func:`_portable`, the final
    full state dict): without this, a run under ``--mesh ...,tp=N`` printed torch's note about it on
    the user's console, a paragraph that reads like a warning about the training's results."""
    note = _NotTheStridedGather()
    logger = logging.getLogger(_REDISTRIBUTE_LOGGER)
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)


def _strided_one(placement: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def _restored(loaded: Any, layout: Any) -> Any:
    """``loaded`` (read into :func:`_portable`'s layout) put back into ``layout``'s placements."""
    if isinstance(layout, dict):
        return {key: _restored(loaded[key], value) for key, value in layout.items()}
    if isinstance(layout, list):
        return [_restored(a, b) for a, b in zip(loaded, layout)]
    if _strided(layout):
        return loaded.redistribute(placements=layout.placements)
    return loaded


#: Less free space than this after a failed write: the file system is full (see :func:`write_failure`).
_FULL_BELOW = 1 << 20


def _save(state: dict[str, Any], directory: Path, background: Optional[ShardedSave] = None,
          coordinator: bool = False) -> None:
    """``dcp.save``, whose failure on any rank is raised on every rank as an OSError.

    With ``background`` (``--async-checkpoint``): ``dcp.async_save`` instead, which copies the
    shards into host memory before it returns and writes them in its own thread, its collectives
    on ``background.group``; ``background.wait`` is set to what waits for them (:func:`_written`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if background is not None:
        with _quiet_without_group():
            future = dcp.async_save(state, checkpoint_id=str(directory), process_group=background.group)
        background.wait = partial(_written, future, directory, coordinator)
        return
    with _quiet_without_group():
        try:
            dcp.save(state, checkpoint_id=str(directory))
        except CheckpointException as exc:
            # DCP raises it on every rank when any rank's write failed; it is a BaseException, which
            # nothing above expects (it went past the worker's error record), and its text is every
            # rank's traceback. The checkpoint manager turns the OSError into its one line.
            raise write_failure(exc.failures, directory) from None


def _written(future: Any, directory: Path, coordinator: bool) -> None:
    """Wait for an ``async_save``'s ``future``: OSError as :func:`_save` raises it when a write failed
    on any rank; then, on the ``coordinator`` (the rank that finishes the checkpoint),
    CheckpointError when shards are missing (:func:`missing_shards`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        future.result()
    except CheckpointException as exc:
        raise write_failure(exc.failures, directory) from None
    error = missing_shards(directory) if coordinator else None
    if error is not None:
        raise CheckpointError(error)


def write_failure(failures: dict[int, Any], directory: Path) -> OSError:
    """The OSError behind DCP's ``failures`` (rank -> (exception, traceback)) of a write into ``directory``.

    A rank's OSError is kept as it is. ``torch.save`` reports a write cut short by a full disk as a
    RuntimeError ("unexpected pos ..."), not as ENOSPC; so when the file system holds (almost)
    nothing free after the failed write, the cause is taken to be a full disk.
    """
    errors = [pair[0] if isinstance(pair, tuple) else pair for _, pair in sorted(failures.items())]
    for error in errors:
        if isinstance(error, OSError):
            return error
    try:
        full = shutil.disk_usage(directory).free < _FULL_BELOW
    except OSError:
        full = False
    if full:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    first = " ".join(str(errors[0]).split())[:200] if errors else "no error given"
    return OSError(errno.EIO, f"torch.distributed.checkpoint could not write it ({first})", str(directory))


def save_state(module: nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
               background: Optional[ShardedSave] = None, coordinator: bool = False) -> None:
    """Every rank writes its part of the model and optimizer state into ``directory``; OSError on
    every rank when any rank's write failed (:func:`write_failure`). With ``background``, in DCP's
    thread (:func:`_save`; ``coordinator``: this rank checks, once written, that every shard is there)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    _save(_portable({MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}), directory, background, coordinator)


def load_state(module: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load the state :func:`save_state` wrote (by any number of ranks) into this run's model and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    # The template has this run's layout; an optimizer that has not stepped yet gets its
    # state initialised first (a step with zero gradients and lr 0), so there is room to load into.
    model_state, optim_state = get_state_dict(module, optimizer)
    layout = {MODEL_KEY: model_state, OPTIMIZER_KEY: optim_state}
    state = _portable(layout)
    _load(state, directory)
    state = _restored(state, layout)
    set_state_dict(module, optimizer, model_state_dict=state[MODEL_KEY], optim_state_dict=state[OPTIMIZER_KEY])


def _load(state: dict[str, Any], directory: Path) -> None:
    """``dcp.load`` of ``state`` from ``directory`` with :func:`_reader` and :func:`_planner`.
    A refused file raises its CheckpointError; any other failure a RuntimeError with DCP's reason."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    with _quiet_without_group():
        try:
            dcp.load(state, storage_reader=_reader(directory), planner=_planner(directory))
        except CheckpointException as exc:
            # A BaseException that DCP raises on every rank when any rank failed.
            errors = [pair[0] if isinstance(pair, tuple) else pair for _, pair in sorted(exc.failures.items())]
            refused = [e for e in errors if isinstance(e, CheckpointError)]
            if refused:
                raise refused[0] from None
            first = " ".join(str(errors[0]).split()) if errors else str(exc)
            raise RuntimeError(f"torch.distributed.checkpoint could not load it: {first}") from None


def read_metadata(directory: Path) -> Any:
    """A DCP checkpoint's ``.metadata``, read without running code, every data file it names
    checked to lie inside ``directory``; CheckpointError naming the file otherwise."""
    path = directory / METADATA_FILE
    metadata = load_metadata(path)
    inside = directory.resolve()
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        target = (directory / str(name)).resolve()
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or target.parent != inside:
            raise CheckpointError(f"refusing to load {str(path)!r}: it names the data file {str(name)[:80]!r}, "
                                  "which is not a file inside its checkpoint directory; this file was not "
                                  "written by torch.distributed.checkpoint or was tampered with")
    return metadata


def _reader(directory: Path) -> Any:
    """DCP's file reader for ``directory``, with ``.metadata`` read by :func:`read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:   # per-rank metadata: scaleloop never writes it
                raise CheckpointError(f"{str(directory)!r}: per-rank DCP metadata is not read by scaleloop")
            metadata = read_metadata(directory)
            # As DCP's own reader does: the id of this load, for its logs.
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    return CheckedReader(str(directory))


def _planner(directory: Path) -> Any:
    """DCP's default load planner, with byte entries read weights-only (a class made here: DCP is
    imported only when a sharded checkpoint is read)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DCP's load planner, with byte entries (non-tensor values) read weights-only: DCP's
        own planner unpickles them with ``weights_only=False``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                info = (self.metadata.storage_data or {}).get(read_item.storage_index)
                file = directory / getattr(info, "relative_path", "?")
                raise CheckpointError(f"refusing to load {str(file)!r}: its entry {fqn!r} holds pickled Python "
                                      "objects that weights-only loading does not allow; this file was not written "
                                      "by scaleloop or was tampered with (nothing in it was run)") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return WeightsOnlyPlanner()


def _renamed(model_state: dict[str, Any], optim_state: dict[str, Any], names: dict[str, list[str]],
             all_params: list[str], every_name: bool) -> dict[str, Any]:
    """A module's ``get_state_dict`` under other names: ``names[key]`` are the names its tensor
    has in the whole model (``every_name``: under each of them, else the first); the optimizer's
    groups list ``all_params``, the same on every rank, so that any rank's copy of them is right."""
    model = {new: value for key, value in model_state.items()
             for new in (names[key] if every_name else names[key][:1])}
    state = {names[key][0]: value for key, value in optim_state["state"].items()}
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(all_params)}
              for group in optim_state["param_groups"]]
    return {MODEL_KEY: model, OPTIMIZER_KEY: {"state": state, "param_groups": groups}}


def save_named(module: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, names: dict[str, list[str]],
               all_params: list[str], background: Optional[ShardedSave] = None, coordinator: bool = False) -> None:
    """As :func:`save_state` for a module that holds part of a model (a pipeline's stages): each
    rank writes its tensors under the whole model's names (``names``: its ``state_dict`` key ->
    those names), so that the files read back like a whole model's (DCP keeps one copy of a key
    that several ranks write: a tied weight, a replica). OSError, ``background``: as for :func:`save_state`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)
    _save(_renamed(model_state, optim_state, names, all_params, every_name=True), directory, background, coordinator)


def load_named(module: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, names: dict[str, list[str]],
               all_params: list[str]) -> None:
    """Load this rank's part of a sharded checkpoint (written by :func:`save_state` or
    :func:`save_named`, any world size) into a module that holds part of the model."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(module, optimizer)   # (initialises the optimizer's state)
    state = _renamed(model_state, optim_state, names, all_params, every_name=False)
    _load(state, directory)
    model = {key: state[MODEL_KEY][names[key][0]] for key in model_state}
    saved_groups = state[OPTIMIZER_KEY]["param_groups"]
    optim = {"state": {key: state[OPTIMIZER_KEY]["state"][names[key][0]] for key in optim_state["state"]},
             "param_groups": [{**{k: v for k, v in saved.items() if k != "params"}, "params": mine["params"]}
                              for saved, mine in zip(saved_groups, optim_state["param_groups"])]}
    set_state_dict(module, optimizer, model_state_dict=model, optim_state_dict=optim)


def saved_model_shapes(directory: Path) -> dict[str, Optional[torch.Size]]:
    """Each model entry of a DCP checkpoint with its global shape (None: not a tensor), from ``.metadata``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(directory)
    prefix = MODEL_KEY + "."
    return {key[len(prefix):]: (md.size if isinstance(md, TensorStorageMetadata) else None)
            for key, md in metadata.state_dict_metadata.items() if key.startswith(prefix)}


def referenced_files(directory: Path) -> set[str]:
    """The data files (relative names) that a DCP checkpoint's ``.metadata`` says hold its tensors."""
    metadata = read_metadata(directory)
    storage = metadata.storage_data or {}
    return {info.relative_path for info in storage.values()}


def missing_shards(directory: Path) -> Optional[str]:
    """On rank 0, after every rank wrote its shards: None if all of them are in ``directory``,
    else what is missing and why that happens (no file system shared by all nodes)."""
    present = {p.name for p in directory.iterdir()}
    missing = sorted(referenced_files(directory) - present) if METADATA_FILE in present else ["(.metadata)"]
    if not missing:
        return None
    return (f"sharded checkpoint {str(directory)!r} is incomplete: {', '.join(missing[:4])} written by other ranks "
            "are not there; every rank writes its own shards, so the run directory must be on a file system "
            "that all nodes share")
