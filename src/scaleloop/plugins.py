"""Resolve user code given as ``package.module:attribute`` (for --model and --data)."""
from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable

from scaleloop.errors import UsageError


def is_factory_spec(spec: str) -> bool:
    """True when ``spec`` names user code (``pkg.module:factory``) rather than a built-in."""
    return ":" in spec


def resolve_factory(spec: str, what: str) -> Callable[..., Any]:
    """Import ``pkg.module:factory`` and return the callable; UsageError naming the problem.

    The current directory is searched first, as ``python -m`` would, so that a user's
    ``mymodels.py`` beside their config works without installing it.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--{what} {spec!r}: expected 'package.module:factory'")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import failure is the user's to fix, not ours to trace
        raise UsageError(
            f"--{what} {spec!r}: cannot import module {module_name!r} "
            f"({type(exc).__name__}: {exc}); check the module path and that it is importable"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"--{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"--{what} {spec!r}: {attr!r} is not callable")
    return obj


def call_factory(factory: Callable[..., Any], arg: Any) -> Any:
    """Call ``factory()`` if it takes no required argument, else ``factory(arg)``."""
    try:
        params = [
            p for p in inspect.signature(factory).parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    return factory(arg) if params else factory()
