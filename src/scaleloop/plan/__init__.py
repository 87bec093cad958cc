"""``scaleloop plan``: will a model fit on N GPUs, and which layout trains it fastest (docs/planning.md).

Small modules, bottom up:

- ``trace``      live tensor bytes op by op of one step, on fake tensors (a ``TorchDispatchMode``)
- ``profile``    the model on the meta device: parameter counts, FLOPs, the traced step with and without
                 activation checkpointing (``ModelSpec``, ``profile_model``)
- ``tplocal``    one tensor-parallel rank's slices of the layers, to trace what that rank keeps
- ``target``     the GPUs: memory, peak FLOP/s, NVLink inside a node, InfiniBand between (``--gpu``)
- ``layouts``    the candidates (dp, fsdp, hsdp, fsdp x tp, pp x dp, +ac, +offload) and their train flags
- ``memory``     a layout's per-rank peak: parameters, gradients, optimizer state, activations, buffers
- ``stepping``   a layout's TinyGPT built and stepped on the CPU (real or fake process group)
- ``hostwork``   the host's own work per layout (FSDP's hooks, DTensor's dispatch), measured at tiny
                 widths on a fake process group (``--measure-host``)
- ``timing``     a layout's step time: compute at a stated MFU, communication over the links, the host's work
- ``report``     the ranked table, the recommendation with its ``scaleloop train`` line, why the others lost
- ``planner``    all of it for one model and target (what ``scaleloop plan`` prints)
- ``tune``       the largest per-device batch that fits, found by trying real steps (``scaleloop tune-batch``,
                 ``scaleloop.find_max_batch``)

The plan's check against CPU measurements and published figures is repository tooling, outside
the package: ``tools/plan_validate``.
"""
