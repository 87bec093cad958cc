"""The largest per-device batch that fits in accelerator memory, found by trying it.

Each try is a real training step (forward, backward, optimizer step) at one per-device batch
size. Sizes double from ``start`` until a step runs out of memory (or ``max_batch`` is
reached); a binary search between the last size that fitted and the first that did not then
finds the exact limit. The search itself (``search_max_batch``) only needs a ``fits(batch)``
predicate, so it is tested on the CPU with a fake one; ``StepProbe`` turns a real training
step into that predicate, and ``find_max_batch`` puts the two together on a CUDA or MPS device.
``tune_batch`` runs that search for one ``TrainConfig`` (``scaleloop tune-batch``): its model,
data, optimizer and precision, built as ``scaleloop train`` builds them.
"""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from scaleloop.data.batching import check_batch_split
from scaleloop.data.batch import TargetRoute, call_model, move, split, take, tensors_of
from scaleloop.runtime.devices import describe_device, device_for_local_rank, resolve_device
from scaleloop.errors import UsageError
from scaleloop.strategies.precision import Precision

Fits = Callable[[int], bool]
SampleFn = Callable[[int], tuple[Any, Any]]
LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

DEFAULT_MAX_BATCH = 1 << 16

# Out-of-memory errors that do not (yet) arrive as torch.OutOfMemoryError.
_OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


@dataclass(frozen=True)
class Trial:
    """One try: a per-device batch size and whether its training step fitted."""

    batch: int
    fits: bool
    peak_bytes: Optional[int] = None  # peak allocated accelerator memory in the step (CUDA)


@dataclass(frozen=True)
class BatchSearch:
    """What the search found: the largest per-device batch that fits, and every try."""

    max_batch: int              # largest per-device batch whose training step fitted
    trials: tuple[Trial, ...]   # in the order tried
    capped: bool                # stopped at ``cap`` with memory to spare: memory is not the limit
    cap: int                    # the largest size the search would try

    def global_batch(self, world_size: int = 1, accumulate: int = 1, multiple_of: int = 1) -> int:
        """The largest global ``--batch-size`` whose per-device micro-batch fits.

        per-device batch = global / (world_size x accumulate), so the answer is the largest
        fitting per-device batch (rounded down to a multiple of ``multiple_of`` where one
        fits, e.g. 8 for tensor cores) times ``world_size x accumulate``: a value the CLI's
        batch rule accepts.
        """
        if world_size < 1 or accumulate < 1 or multiple_of < 1:
            raise ValueError("world_size, accumulate and multiple_of must be positive")
        per_device = self.max_batch
        if per_device >= multiple_of:
            per_device -= per_device % multiple_of
        batch = per_device * world_size * accumulate
        check_batch_split(batch, world_size, accumulate)
        return batch


def search_max_batch(fits: Fits, *, start: int = 1, max_batch: int = DEFAULT_MAX_BATCH,
                     device_name: str = "the device") -> BatchSearch:
    """Largest ``batch`` in ``[1, max_batch]`` with ``fits(batch)``, assuming fitting is monotone.

    Doubles from ``start`` until a size fails or ``max_batch`` fits, then binary-searches
    between the last success and the first failure (below ``start`` if ``start`` already
    fails). Each size is tried at most once. Raises ``UsageError`` when not even 1 fits.
    """
    if start < 1 or max_batch < start:
        raise ValueError(f"need 1 <= start <= max_batch, got start={start}, max_batch={max_batch}")
    trials: list[Trial] = []

    def attempt(batch: int) -> bool:
        ok = bool(fits(batch))
        trials.append(Trial(batch, ok))
        return ok

    good, bad = 0, None  # largest size known to fit, smallest known not to
    batch = start
    while True:
        if not attempt(batch):
            bad = batch
            break
        good = batch
        if batch >= max_batch:
            break
        batch = min(2 * batch, max_batch)
    if bad is not None:
        while bad - good > 1:
            mid = (good + bad) // 2
            if attempt(mid):
                good = mid
            else:
                bad = mid
    if good == 0:
        raise UsageError(f"not even a per-device batch of 1 fits in the memory of {device_name}; "
                         "use --precision bf16, a smaller model, or a device with more memory")
    return BatchSearch(max_batch=good, trials=tuple(trials), capped=bad is None, cap=max_batch)


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an accelerator running out of memory (CUDA, cuBLAS/cuDNN workspaces, MPS)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


class StepProbe:
    """``probe(batch)``: run ``steps`` training steps at that batch; False if memory runs out.

    ``model`` must already be on ``device``; ``sample(batch)`` returns ``(x, y)`` (moved to
    ``device`` here). Two steps by default: the first also allocates the optimizer's state,
    the second runs with it in place, as training does. Errors other than running out of
    memory propagate. Memory is released after every try, so the next one starts clean;
    ``peaks`` maps each tried batch to its peak allocated memory (CUDA only).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sample: SampleFn, loss: LossFn,
                 device: torch.device, precision: Optional[Precision] = None, steps: int = 2) -> None:
        self.model = model
        self.optimizer = optimizer
        self.sample = sample
        self.loss = loss
        self.device = device
        self.precision = precision or Precision("fp32", device)
        self.steps = steps
        self.peaks: dict[int, int] = {}

    def __call__(self, batch: int) -> bool:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self._train(batch)
            ok = not _over_mps_budget(self.device)
        except Exception as exc:  # noqa: BLE001 - anything but running out of memory is re-raised
            if not is_out_of_memory(exc):
                raise
            ok = False
        # The step's tensors lived in _train's frame, which the exception's traceback kept
        # alive until the except block ended; now they can be freed.
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            self.peaks[batch] = torch.cuda.max_memory_allocated(self.device)
        _release(self.device, collect=not ok)
        return ok

    def _train(self, batch: int) -> None:
        for _ in range(self.steps):
            x, y = move(self.sample(batch), self.device)
            with self.precision.autocast():
                value = self.loss(call_model(self.model, x), y)
            self.precision.scale(value).backward()
            self.precision.step(self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        _synchronize(self.device)


def sample_from(dataset: Dataset, keep_target: TargetRoute = False) -> SampleFn:
    """``sample(batch)``: ``(inputs, target)`` of the first ``batch`` samples of ``dataset``
    (repeated when it is smaller), cut as the loader cuts them (``scaleloop.data.batch``)."""
    n = len(dataset)  # type: ignore[arg-type]
    if n < 1:
        raise UsageError("the dataset is empty: there is nothing to size a batch with")
    columns = tensors_of(dataset)

    def sample(batch: int) -> tuple[Any, Any]:
        index = torch.arange(batch) % n
        if columns is not None:
            return split(take(columns, index), keep_target)
        return split(default_collate([dataset[i] for i in index.tolist()]), keep_target)

    return sample


def find_max_batch(model: Union[nn.Module, Callable[[], nn.Module]], data: Union[SampleFn, Dataset],
                   device: Union[torch.device, str] = "auto", *, loss: Optional[LossFn] = None,
                   optimizer: Optional[OptimizerFactory] = None, precision: str = "fp32",
                   start: int = 1, max_batch: int = DEFAULT_MAX_BATCH, steps: int = 2) -> BatchSearch:
    """The largest per-device batch whose training step fits in ``device``'s memory.

    ``model`` is a module or a no-argument factory; a module's weights, device and train/eval
    mode are restored afterwards (the tries do take optimizer steps). ``data`` is a Dataset
    (its first samples are used) or ``sample(batch) -> (x, y)``. ``loss(output, y)`` defaults
    to the mean square of the output (any scalar that depends on every output costs the same
    backward pass); ``optimizer`` to AdamW, whose two state tensors per parameter match or
    exceed the common optimizers. Use the precision you will train with: bf16/fp16 activations
    take half the memory. ``max_batch`` caps the search.

    Only for accelerators: on the CPU it raises ``UsageError`` (see ``require_accelerator``).
    """
    dev = accelerator(device)
    sample = data if callable(data) and not isinstance(data, Dataset) else sample_from(data)  # type: ignore[arg-type]
    owned = not isinstance(model, nn.Module)
    net: nn.Module = model() if owned else model  # type: ignore[operator]
    saved = None
    if not owned:
        # A CPU copy (not a device one, which would take memory from the search).
        first = next(net.parameters(), None)
        home = first.device if first is not None else torch.device("cpu")
        saved = ({k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}, net.training, home)
    try:
        net.to(dev).train()
        opt = (optimizer or (lambda p: torch.optim.AdamW(p, lr=1e-3)))(net.parameters())
        probe = StepProbe(net, opt, sample, loss or _mean_square, dev, Precision(precision, dev), steps)
        result = search_max_batch(probe, start=start, max_batch=max_batch, device_name=describe_device(dev))
        peaks = probe.peaks
        del opt, probe
    finally:
        if saved is not None:
            state, training, home = saved
            net.load_state_dict(state)
            net.to(home).train(training)
        _release(dev)
    return dataclasses.replace(result, trials=tuple(
        dataclasses.replace(t, peak_bytes=peaks.get(t.batch)) for t in result.trials))


def require_accelerator(device: torch.device) -> None:
    """Raise ``UsageError`` unless ``device`` is CUDA or MPS."""
    if device.type not in ("cuda", "mps"):
        raise UsageError(
            f"batch-size search applies to accelerators (CUDA, MPS) only, and this run is on {device.type}: "
            "CPU memory rarely limits the batch (running out swaps or kills rather than failing cleanly); "
            "pick --batch-size by hand")


def accelerator(device: Union[torch.device, str]) -> torch.device:
    """The device a search runs on: local rank 0's of ``device``; UsageError for the CPU."""
    dev = resolve_device(str(device))  # also says so when CUDA/MPS is not available here
    require_accelerator(dev)
    return device_for_local_rank(dev, 0)


def _mean_square(output: Any, _target: Any) -> torch.Tensor:
    from scaleloop.loop.losses import prediction_of

    return prediction_of(output).float().square().mean()


def _release(device: torch.device, collect: bool = True) -> None:
    # Tensors are freed by reference counting once unreachable; a full (slow) garbage
    # collection is for what a failed step may have left in reference cycles.
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()


def _synchronize(device: torch.device) -> None:
    # Kernels run asynchronously: wait, so that a failure inside the step is raised here.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _over_mps_budget(device: torch.device) -> bool:
    # MPS shares the machine's memory and can page to disk long before it raises an error;
    # count a step as not fitting once it goes past what Metal recommends for this process.
    if device.type != "mps":
        return False
    return torch.mps.driver_allocated_memory() > torch.mps.recommended_max_memory()


# --- scaleloop tune-batch: the search for one run's config -------------------------------------
@dataclass(frozen=True)
class TuneReport:
    """``tune_batch``'s answer for one ``TrainConfig``."""

    search: BatchSearch
    device: str                 # e.g. "cuda:0 (NVIDIA H100 80GB HBM3)"
    workers: int                # devices the global batch is split over
    accumulate: int
    train_samples: int
    total_bytes: Optional[int]  # the device's memory (CUDA)

    @property
    def batch_size(self) -> int:
        """The largest global ``--batch-size`` whose per-device micro-batch fits."""
        return self.search.global_batch(self.workers, self.accumulate)


def tune_batch(cfg: Any) -> TuneReport:
    """Run the search for a ``TrainConfig``: its model, data, optimizer and precision.

    Model and data are built as ``scaleloop train`` builds them; the search runs on one
    device (local rank 0's), without a process group. Pass the config as it will be launched
    (``nproc`` already set to one process per GPU where ``--strategy auto`` does that).
    """
    from scaleloop.data.batch import keeps_target
    from scaleloop.loop.build import build_data_and_model, build_optimizer
    from scaleloop.loop.losses import resolve_loss

    device = accelerator(cfg.launch.device)
    data, model = build_data_and_model(cfg)
    info = data.info
    # nn.DataParallel splits one process's batch over every GPU; otherwise one device per process.
    workers = torch.cuda.device_count() if cfg.parallel.strategy == "dp" and device.type == "cuda" else cfg.world_size
    # A per-device micro-batch never holds more than its share of the training set.
    cap = max(1, -(-len(data.train) // (workers * cfg.parallel.accumulate)))
    sample = sample_from(data.train, keeps_target(model, data.train))
    search = find_max_batch(lambda: model, sample, device, loss=resolve_loss(cfg.model_data.loss, info),
                            optimizer=lambda params: build_optimizer(cfg, params, model=model),
                            precision=cfg.parallel.precision, max_batch=cap)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return TuneReport(search=search, device=describe_device(device), workers=workers,
                      accumulate=cfg.parallel.accumulate, train_samples=len(data.train), total_bytes=total)
