"""The check of ``scaleloop plan`` against measurement and published figures (docs/planning.md).

Repository tooling, not installed: ``python tools/plan_validate [--out DIR] ...`` from the
repository's root (``--help`` for the flags), or, in CI and ``make gpu-check``, its parts
imported with ``tools/`` on the path. What the plan itself runs (``--measure-host``) stays in the
package: ``scaleloop.plan.stepping`` and ``scaleloop.plan.hostwork``.

- ``measure``      a layout on N CPU processes (real Gloo groups, the real strategies): each rank's
                   peak tensor memory under the profiler, the step time, the fabric's timings
- ``turns``        the step times of several layouts measured in turns on the same processes
- ``validate``     the benchmark: three TinyGPT sizes x the 4-process layouts, predicted against
                   measured, written to ``benchmarks/``; and ``--against-tune-batch`` on a GPU
- ``published``    the memory model against published figures (ZeRO's Figure 1, Megatron's
                   equation 1, torchtitan's FSDP runs)
- ``__main__``     the entry point: ``validate.main``
"""
