"""Replacing a method on a framework's class, also where the class is an immutable extension type.

CuPy's `Stream` is a plain class, so `setattr` works. cuda.core's `GraphBuilder`
is a Cython `cdef class` (an immutable static type): `setattr` raises
TypeError, so the entry is written into the type's own dictionary and
CPython's method cache for the type is invalidated (`PyType_Modified`). Only
calls that look the method up by name (every Python-level call) see the
replacement; the framework's C-level calls to itself do not.
"""

from __future__ import annotations

import ctypes
import gc
import platform
from typing import Any

from capsafe.errors import CapsafeError


def _type_dict(cls: type) -> dict[str, Any]:
    if platform.python_implementation() != "CPython":
        raise CapsafeError(f"cannot patch the extension type {cls.__qualname__} outside CPython")
    (real,) = [r for r in gc.get_referents(cls.__dict__) if isinstance(r, dict)]
    return real


def set_class_attr(cls: type, name: str, value: Any) -> None:
    """`cls.name = value`, writing through an immutable type's dictionary when needed."""
    try:
        setattr(cls, name, value)
    except TypeError:
        _type_dict(cls)[name] = value
        ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))


class Patches:
    """Class attributes replaced together, and put back in reverse order by `restore()`."""

    def __init__(self) -> None:
        self._saved: list[tuple[type, str, Any]] = []

    def replace(self, cls: type, name: str, value: Any) -> Any:
        """Replace `cls.name` (defined on `cls` itself); returns the original."""
        original = cls.__dict__[name]
        set_class_attr(cls, name, value)
        self._saved.append((cls, name, original))
        return original

    def restore(self) -> None:
        while self._saved:
            cls, name, original = self._saved.pop()
            set_class_attr(cls, name, original)


def defining_class(cls: type, name: str) -> type:
    """The class in `cls.__mro__` whose own dictionary defines `name`."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass
    raise CapsafeError(f"{cls.__qualname__} has no attribute {name!r} to hook")
