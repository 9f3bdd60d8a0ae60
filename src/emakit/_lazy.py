"""Lazy package attributes (PEP 562): a package exports names without importing them.

``emakit`` and ``emakit.demo`` import nothing heavy when they are imported; each exported
name is imported from its module on first access and then cached in the package. This is
what lets ``emakit --help`` and ``emakit --version`` answer without loading torch (the
command line lives inside the package, so the package is imported first).

Example:
    >>> import emakit
    >>> emakit.EMA.__module__  # imported now, on first access
    'emakit.ema'
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of a package with lazy exports.

    Args:
        package: the package's ``__name__``.
        exports: exported name -> the submodule (relative to ``package``) that defines it;
            an empty string means the name is itself a submodule (``"schedules": ""``).
        namespace: the package's ``globals()``: a resolved name is stored there, so the
            next access is a plain attribute read.

    Returns:
        ``(__getattr__, __dir__)`` to assign in the package. ``__getattr__`` also resolves
        any submodule of the package by name (``emakit._engine``), as an eager package
        that imported it would; anything else raises ``AttributeError``.
    """

    def __getattr__(name: str) -> Any:  # noqa: N807 - PEP 562 hook
        where = exports.get(name)
        if where == "":
            value: Any = importlib.import_module(f"{package}.{name}")
        elif where is not None:
            value = getattr(importlib.import_module(f"{package}.{where}"), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807 - PEP 562 hook
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
