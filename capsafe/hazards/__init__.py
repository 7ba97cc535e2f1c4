"""The capture hazards: which driver call breaks which open capture, and the calls themselves.

- `table`: the rule table, the single source of truth (re-exported here, so
  `from capsafe import hazards; hazards.rule_for(...)` reads it);
- `calls`: facade methods named the way the table names calls;
- `actions`: each table row made as real facade calls;
- `trial`: one measured cell of the hazard matrix (the facade never imports it).

Importing the package loads `table` only; the other modules are imported by name.
"""

from __future__ import annotations

from capsafe.hazards.table import (
    ACTIVE,
    ALLOCATOR_CALLS,
    ALWAYS_CALLS,
    CALLERS,
    CALLS,
    CAPTURE_BREAKING_CALLS,
    CAPTURE_STREAMS,
    DEVICES,
    IMPLICIT,
    INVALIDATED,
    LEFT_OPEN,
    LEGACY_STREAM_CALLS,
    MODE_FORBIDDEN_CALLS,
    MODES,
    OTHER_DEVICE,
    OTHER_THREAD,
    RULES,
    SAME_DEVICE,
    SAME_THREAD,
    STATES,
    SUCCESS,
    UNSUPPORTED,
    Cell,
    Outcome,
    Rule,
    cells,
    ever_breaks,
    expected,
    measured,
    rule_for,
)

__all__ = [
    "ACTIVE",
    "ALLOCATOR_CALLS",
    "ALWAYS_CALLS",
    "CALLERS",
    "CALLS",
    "CAPTURE_BREAKING_CALLS",
    "CAPTURE_STREAMS",
    "DEVICES",
    "IMPLICIT",
    "INVALIDATED",
    "LEFT_OPEN",
    "LEGACY_STREAM_CALLS",
    "MODES",
    "MODE_FORBIDDEN_CALLS",
    "OTHER_DEVICE",
    "OTHER_THREAD",
    "RULES",
    "SAME_DEVICE",
    "SAME_THREAD",
    "STATES",
    "SUCCESS",
    "UNSUPPORTED",
    "Cell",
    "Outcome",
    "Rule",
    "cells",
    "ever_breaks",
    "expected",
    "measured",
    "rule_for",
]
