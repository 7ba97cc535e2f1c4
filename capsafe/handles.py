"""Typed handles for driver objects.

Bare integers get mixed up (a stream passed where an event belongs); these small
frozen objects make such mistakes a TypeError at the facade instead of a
CUDA_ERROR_INVALID_HANDLE three calls later. `value` is the raw driver handle
(an address for pointers); `raw` on some handles keeps the backend's own object.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from capsafe.errors import UsageError


class StreamKind(enum.StrEnum):
    LEGACY = "legacy"  # the NULL stream: implicitly synchronizes with blocking streams
    BLOCKING = "blocking"  # cuStreamCreate(CU_STREAM_DEFAULT)
    NONBLOCKING = "nonblocking"  # cuStreamCreate(CU_STREAM_NON_BLOCKING)


class CaptureMode(enum.StrEnum):
    GLOBAL = "global"
    THREAD_LOCAL = "thread_local"
    RELAXED = "relaxed"

    @classmethod
    def parse(cls, value: str | CaptureMode) -> CaptureMode:
        """Any case of a mode name; a user's typo is a one-line UsageError (a ValueError)."""
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise UsageError(f"unknown capture mode {value!r}; expected one of: {names}") from None


class CaptureStatus(enum.StrEnum):
    NONE = "none"
    ACTIVE = "active"
    INVALIDATED = "invalidated"


@dataclass(frozen=True, slots=True)
class Handle:
    value: int
    raw: Any = field(default=None, compare=False, repr=False)

    def __int__(self) -> int:
        return self.value


@dataclass(frozen=True, slots=True)
class Device(Handle):
    ordinal: int = 0


@dataclass(frozen=True, slots=True)
class Context(Handle):
    pass


@dataclass(frozen=True, slots=True)
class Stream(Handle):
    kind: StreamKind = StreamKind.NONBLOCKING


@dataclass(frozen=True, slots=True)
class Event(Handle):
    pass


@dataclass(frozen=True, slots=True)
class Graph(Handle):
    pass


@dataclass(frozen=True, slots=True)
class GraphExec(Handle):
    pass


@dataclass(frozen=True, slots=True)
class DevicePtr(Handle):
    size: int = 0

    def __add__(self, offset: int) -> DevicePtr:
        return DevicePtr(self.value + offset, size=max(self.size - offset, 0))


@dataclass(frozen=True, slots=True)
class HostPtr(Handle):
    """Page-locked host memory; `buffer` is a writable memoryview over it."""

    size: int = 0
    buffer: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Module(Handle):
    pass


@dataclass(frozen=True, slots=True)
class Function(Handle):
    name: str = ""
    module: Module | None = None


@dataclass(frozen=True, slots=True)
class MemHandle(Handle):
    """A physical allocation from cuMemCreate (VMM)."""

    size: int = 0


LEGACY_STREAM = Stream(0, kind=StreamKind.LEGACY)
