"""Names whose module moved: the old import paths keep working for one release, with a warning.

0.2.0 split the core into stages (``core.planner`` became ``core.planning.planner``, ``core.engine``
``core.running.engine``, …). A DAG file that imports from an old path must not go stale under the
dag-processor the day the package is upgraded: each old module is kept as a thin module whose
``__getattr__`` finds the name at its new home, warns once per name with a :class:`DeprecationWarning`
that names the new path, and returns it. They go in 0.3.0 (CHANGELOG.md). Nothing in the package
imports them; the homes are imported by name, on first use, so that importing an old module stays cheap.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

# Where the public names of the core live, and the stable path to import them from.
PUBLIC_MODULE = "airflow_retention.core"
REMOVED_IN = "0.3.0"


def forwarding(old_module: str, homes: Sequence[str], names: Collection[str] | None = None) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the deprecated module ``old_module``: a name (of ``names``, when
    given: a package must not look its submodules up here) is found in the first of ``homes`` that has
    it, warns once, and is kept in the old module so that it does not warn again (``from a import b``
    looks twice)."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__") or (names is not None and name not in names):
            raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
        value = moved_attribute(old_module, homes, name)
        vars(sys.modules[old_module])[name] = value
        return value

    return __getattr__


def moved_attribute(old_module: str, homes: Sequence[str], name: str) -> Any:
    """``name`` of the deprecated module ``old_module``, found in the first of ``homes`` that has it; the
    warning names ``airflow_retention.core`` for a name of the public core API, else the module that
    defines it. Raises :class:`AttributeError` (as a missing name always does) for any other name."""
    public = importlib.import_module(PUBLIC_MODULE).__all__
    for home in homes:
        module = importlib.import_module(home)
        if name in vars(module):
            value = vars(module)[name]
            # A class or function names the module that defines it; a constant, the first home holding it.
            new = PUBLIC_MODULE if name in public else getattr(value, "__module__", None) or home
            warnings.warn(
                f"{old_module}.{name} moved: import it from {new} (the old path is deprecated and works until"
                f" airflow-retention {REMOVED_IN}; see CHANGELOG.md)",
                DeprecationWarning,
                stacklevel=3,
            )
            return value
    raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
