"""What a capture gate tells about itself: counters, holders and its timeout messages.

Kept apart from the waits and the release so that reading the gate (`stats()`,
`holders()`, the text of a `GateTimeout`) is one role: none of it changes what the
gate lets through.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from capsafe._diagnostics import (
    Holder,
    capture_timeout_message,
    current_frames,
    format_site,
    holder_site,
    shared_timeout_message,
    site_of,
)
from capsafe._gate_state import _SHARED_WAIT, _GateState, _Record


@dataclass(frozen=True)
class GateStats:
    """Counters since the gate was created (or since fork)."""

    shared_entered: int  # outermost shared sections entered (nested re-entries not counted)
    contended_waits: int  # shared sections that had to wait for a capture
    capture_waits: int  # captures that had to wait for shared holders or another capture
    max_wait_s: float  # the longest single wait, shared or capture
    bypassed: int  # shared sections the capturing thread entered inside its own window
    admitted_measured: int  # sections the measured policy let run beside an open capture
    captures: int  # exclusive windows taken
    deferred: int  # callables deferred to the end of a capture (teardown during capture)
    open_captures: int
    holders: tuple[Holder, ...]


class _GateObservability(_GateState):
    """The gate's counters and holders, read under its lock."""

    def bypassed_calls(self) -> Counter[str]:
        """Calls capturing threads made inside their own windows, by name (a copy)."""
        with self._lock:
            return Counter(self._bypassed_calls)

    def _note_wait(self, seconds: float) -> None:
        if seconds > self._max_wait:
            self._max_wait = seconds

    def holders(self) -> tuple[Holder, ...]:
        """Threads holding or waiting for the gate now, with call sites from their live stacks."""
        with self._lock:
            return self._holders_locked()

    def _holders_locked(self, skip: _Record | None = None) -> tuple[Holder, ...]:
        # Threads are told apart by their record (one per live Thread object), never by
        # ident: a new thread may reuse an exited holder's ident.
        frames = current_frames()
        owner_guard = self._guards[0] if self._guards else None
        out = []
        for rec in self._records:
            if rec is skip:
                continue
            dead = rec.dead()
            if rec is self._owner:
                role = "capture"
            elif rec.aside:
                role = "waiting capture"
            elif rec.granted and rec.waiting == _SHARED_WAIT:
                role = "granted entry"
            elif rec.depth and not dead:
                role = "shared"
            else:
                continue
            frame = None if dead else frames.get(rec.thread_id)  # a reused ident is not ours
            site = holder_site(frame)
            if role == "capture" and owner_guard is not None:
                site = owner_guard._site
            out.append(
                Holder(
                    rec.thread_name,
                    rec.thread_id,
                    role,
                    abs(rec.depth),
                    format_site(site),
                    format_site(site_of(frame)),
                    exited=dead,
                )
            )
        return tuple(out)

    def _others(self) -> tuple[Holder, ...]:
        return self._holders_locked(skip=getattr(self._tls, "rec", None))

    def _timeout_message(self, label: str, timeout: float | None) -> str:
        return capture_timeout_message(label, timeout, self._others())

    def _shared_timeout_message(self, rec: _Record, call: str | None) -> str:
        guard = self._guards[0] if self._guards else None
        label = guard.label if guard is not None else ""
        return shared_timeout_message(
            call, rec.thread_name, self.shared_timeout, label, self._others()
        )

    def stats(self) -> GateStats:
        with self._lock:
            self._prune()
            entered = self._retired_entered + sum(r.entered for r in self._records)
            return GateStats(
                shared_entered=entered,
                contended_waits=self._contended,
                capture_waits=self._capture_waits,
                max_wait_s=self._max_wait,
                bypassed=self._bypassed,
                admitted_measured=self._admitted,
                captures=self._captures,
                deferred=self._deferred_total,
                open_captures=len(self._guards),
                holders=self._holders_locked(),
            )
