"""The entry file format: a fixed header, JSON metadata, the payload, one checksum over all of it.

The checksum covers every header byte (pad byte and compile-seconds field included), so
any flipped bit anywhere in a file makes it a miss, never a hit with a wrong field.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FORMAT_VERSION = 2  # 2: the checksum covers the whole header
KINDS = {"ptx": 1, "cubin": 2}
MAGIC = b"CSKC"
# magic, format version, kind, pad, meta length, payload length, compile seconds, key
_FIELDS = struct.Struct("<4sHBxIQd32s")
_CHECKSUM_SIZE = 32
HEADER_SIZE = _FIELDS.size + _CHECKSUM_SIZE


@dataclass(frozen=True)
class Entry:
    """What one entry file holds."""

    kind: str
    key: str
    payload: bytes
    meta: Mapping[str, Any]
    compile_seconds: float


def encode(entry: Entry) -> bytes:
    meta = json.dumps(dict(entry.meta), sort_keys=True).encode()
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        KINDS[entry.kind],
        len(meta),
        len(entry.payload),
        _finite_seconds(entry.compile_seconds),
        bytes.fromhex(entry.key),
    )
    return fields + _checksum(fields, meta, entry.payload) + meta + entry.payload


def decode(data: bytes) -> Entry | None:
    """The entry in `data`, or None when anything about it is off."""
    if len(data) < HEADER_SIZE:
        return None
    fields = data[: _FIELDS.size]
    magic, version, kind_code, meta_len, payload_len, seconds, key = _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    if len(data) != HEADER_SIZE + meta_len + payload_len:
        return None
    kind = next((name for name, code in KINDS.items() if code == kind_code), None)
    meta = data[HEADER_SIZE : HEADER_SIZE + meta_len]
    payload = data[HEADER_SIZE + meta_len :]
    if kind is None or data[_FIELDS.size : HEADER_SIZE] != _checksum(fields, meta, payload):
        return None
    if not (math.isfinite(seconds) and seconds >= 0):
        return None  # a writer bug, not damage: still never let it reach the statistics
    try:
        meta_obj = json.loads(meta)
    except ValueError:
        return None
    if not isinstance(meta_obj, dict):
        return None
    return Entry(kind, key.hex(), payload, meta_obj, seconds)


def _finite_seconds(seconds: float) -> float:
    return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0


def _checksum(fields: bytes, meta: bytes, payload: bytes) -> bytes:
    h = hashlib.sha256(fields)
    h.update(meta)
    h.update(payload)
    return h.digest()
