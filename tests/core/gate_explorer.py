"""A small-scope interleaving explorer for the capture gate (used by tests/core/test_gate_model.py).

The real `CaptureGate` code runs on real threads, but one at a time: its lock
and condition variables are replaced by scheduler-controlled ones, and its
clock by a virtual one, so every interleaving is chosen by a seeded random
scheduler and replays exactly. Threads switch at every lock acquire, every
wait and between operations; each wait may be ended by an injected exception
(what Ctrl-C, an async exception or pytest-timeout's signal method does inside
`Condition.wait`, lock re-acquired first, as CPython does). Virtual time moves
only with steps, so a `GateTimeout` means every thread was stuck: a deadlock.

Checked at every switch: no thread outside the gate holds a section that an
open capture of another thread forbids (conservative: any; measured: a call in
its `harmful` set). At the end: the gate is clean and a fresh capture begins.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from capsafe import gate as gate_module
from capsafe.gate import CaptureGate, CaptureGuard, GateTimeout

STEP_S = 1e-4  # virtual seconds per scheduling step
FAVOUR_P = 0.9  # how often a favoured actor that can run is picked
CALLS = (None, "mem_alloc", "ctx_sync")  # None: an unnamed (conservative) section
NARROW = frozenset({"ctx_sync"})  # a measured-policy capture (RELAXED-like)


class Injected(BaseException):
    """The exception the scheduler raises inside a wait."""


class Violation(AssertionError):
    pass


@dataclass
class Actor:
    index: int
    script: list[tuple[str, Any]]
    sections: list[str | None] = field(default_factory=list)
    guards: list[CaptureGuard] = field(default_factory=list)
    in_gate: bool = False
    state: str = "runnable"  # runnable, lock, wait, done
    blocked_on: Any = None
    deadline: float | None = None
    woke: str = ""  # "notified" or "timeout"
    entered: int = 0
    errors: list[str] = field(default_factory=list)
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return f"actor-{self.index}"


class Explorer:
    """Runs actor scripts against one gate under a seeded schedule; `run()` raises on a bug."""

    def __init__(
        self,
        seed: int,
        scripts: list[list[tuple[str, Any]]],
        *,
        inject: float = 0.0,
        favour: int | None = None,
        max_steps: int = 20_000,
        stop_after: Callable[[Explorer], bool] | None = None,
        fairness_s: float = 0.001,
    ) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self.inject = inject
        self.favour = favour  # an actor picked first most of the time (a tight loop)
        self.max_steps = max_steps
        self.stop_after = stop_after
        self.steps = 0
        self.actors = [Actor(i, s) for i, s in enumerate(scripts)]
        self.windows: list[tuple[Actor, CaptureGuard]] = []
        self._baton = threading.Condition(threading.Lock())
        self._turn: Actor | None = None
        self.failure: BaseException | None = None
        self.gate = CaptureGate(fairness_s=fairness_s, shared_timeout=1e6)
        self.gate._lock = ModelLock(self)  # type: ignore[assignment]
        self.gate._may_enter = ModelCondition(self, self.gate._lock)  # type: ignore[arg-type,assignment]
        self.gate._may_capture = ModelCondition(self, self.gate._lock)  # type: ignore[arg-type,assignment]

    # -- scheduling ----------------------------------------------------------------
    def current(self) -> Actor:
        name = threading.current_thread().name
        return self.actors[int(name.rsplit("-", 1)[1])]

    def switch(self) -> None:
        """Give the baton to a scheduler-chosen actor; return when it is ours again."""
        me = self.current()
        self.check_safety()
        nxt = self.pick()
        if nxt is me:
            return
        with self._baton:
            self._turn = nxt
            self._baton.notify_all()
            while self._turn is not me:
                self._baton.wait()

    def pick(self) -> Actor:
        self.steps += 1
        self.now += STEP_S
        if self.steps > self.max_steps:
            raise Violation(f"no progress after {self.max_steps} steps")
        while True:
            for a in self.actors:  # timed waits whose deadline passed wake up
                if a.state == "wait" and a.deadline is not None and a.deadline <= self.now:
                    a.state, a.woke = "runnable", "timeout"
            ready = [a for a in self.actors if a.state == "runnable"]
            if ready:
                favoured = [a for a in ready if a.index == self.favour]
                if favoured and self.rng.random() < FAVOUR_P:
                    return favoured[0]
                return self.rng.choice(ready)
            deadlines = [a.deadline for a in self.actors if a.state == "wait" and a.deadline]
            if not deadlines:
                blocked = [(a.name, a.state) for a in self.actors if a.state != "done"]
                raise Violation(f"deadlock: {blocked}")
            self.now = min(deadlines)

    def block(self, state: str, on: Any, deadline: float | None = None) -> str:
        me = self.current()
        me.state, me.blocked_on, me.deadline, me.woke = state, on, deadline, ""
        self.switch()
        while me.state != "runnable":  # woken only by being made runnable
            self.switch()
        me.blocked_on = me.deadline = None
        return me.woke

    def wake(self, predicate: Callable[[Actor], bool], how: str) -> None:
        for a in self.actors:
            if a.state in ("lock", "wait") and predicate(a):
                a.state, a.woke = "runnable", how

    # -- the invariant ---------------------------------------------------------------
    def check_safety(self) -> None:
        for owner, guard in self.windows:
            for a in self.actors:
                if a is owner or a.in_gate:
                    continue
                for call in a.sections:
                    if guard.harmful is None or call is None or call in guard.harmful:
                        raise Violation(
                            f"{a.name} runs a {call or 'unnamed'} section inside "
                            f"{owner.name}'s capture (harmful={set(guard.harmful or ()) or 'all'})"
                        )

    # -- actors ------------------------------------------------------------------------
    def run(self) -> None:
        saved = gate_module.time  # type: ignore[attr-defined]
        gate_module.time = _VirtualTime(self)  # type: ignore[attr-defined,assignment]
        try:
            for a in self.actors:
                a.thread = threading.Thread(target=self._body, args=(a,), name=a.name)
                a.thread.daemon = True
            self._turn = self.actors[0]
            for a in self.actors:
                assert a.thread is not None
                a.thread.start()
            for a in self.actors:
                assert a.thread is not None
                a.thread.join(120)
                if a.thread.is_alive():
                    raise Violation(f"{a.name} never finished (explorer bug)")
        finally:
            gate_module.time = saved  # type: ignore[attr-defined]
        if self.failure is not None:
            raise self.failure
        for a in self.actors:
            if a.errors:
                raise Violation(f"{a.name}: {a.errors[0]}")
        self.check_clean()

    def check_clean(self) -> None:
        """Every actor is done: the gate holds nothing and a capture begins at once."""
        g = self.gate
        g._lock = threading.RLock()  # back to real primitives, on this (real) thread
        g._may_enter = threading.Condition(g._lock)
        g._may_capture = threading.Condition(g._lock)
        stats = g.stats()
        if stats.open_captures or stats.holders:
            raise Violation(f"gate not clean: {stats.open_captures} open, {stats.holders}")
        try:
            g.begin_capture(timeout=0.5).release()
        except GateTimeout as exc:
            raise Violation(f"the gate is wedged after the run: {exc}") from exc

    def _body(self, actor: Actor) -> None:
        with self._baton:
            while self._turn is not actor:
                self._baton.wait()
        try:
            for op, arg in actor.script:
                if self.failure is not None:
                    break
                if self.stop_after is not None and self.stop_after(self):
                    break
                self.switch()
                self.perform(actor, op, arg)
            self.switch()
            self.cleanup(actor)
        except BaseException as exc:
            if self.failure is None:
                self.failure = exc
        finally:
            actor.state = "done"
            self._hand_off_at_end()

    def _hand_off_at_end(self) -> None:
        with self._baton:
            try:
                nxt = self.pick() if any(a.state != "done" for a in self.actors) else None
            except BaseException as exc:
                if self.failure is None:
                    self.failure = exc
                for a in self.actors:  # let everyone out
                    if a.state != "done":
                        a.state = "runnable"
                nxt = next((a for a in self.actors if a.state != "done"), None)
            self._turn = nxt
            self._baton.notify_all()

    def perform(self, actor: Actor, op: str, arg: Any) -> None:
        g = self.gate
        actor.in_gate = True
        try:
            if op == "enter":
                g.enter(arg)
                actor.sections.append(arg)
                actor.entered += 1
            elif op == "exit" and actor.sections:
                actor.sections.pop()
                g.exit()
            elif op == "begin":
                guard = g.begin_capture(harmful=arg, timeout=1e6)
                actor.guards.append(guard)
                self.windows.append((actor, guard))
            elif op == "release" and actor.guards:
                self._release(actor.guards.pop())
            elif op == "work":  # time passes in the caller's own code (a driver call)
                actor.in_gate = False
                for _ in range(arg):
                    self.switch()
            elif op == "release_other":  # cross-thread release of another's newest guard
                others = [a for a in self.actors if a is not actor and a.guards]
                if others:
                    self._release(others[0].guards.pop())
        except Injected:
            self.unwind(actor)  # the exception propagates out of the `with` blocks
        except GateTimeout as exc:
            raise Violation(f"{actor.name} stuck in {op}: {exc}") from exc
        finally:
            actor.in_gate = False

    def _release(self, guard: CaptureGuard) -> None:
        self.windows = [(o, g) for o, g in self.windows if g is not guard]
        guard.release()

    def unwind(self, actor: Actor) -> None:
        while actor.sections:
            actor.sections.pop()
            self.gate.exit()

    def cleanup(self, actor: Actor) -> None:
        actor.in_gate = True
        while actor.guards:
            self._release(actor.guards.pop())
        self.unwind(actor)
        actor.in_gate = False


class _VirtualTime:
    def __init__(self, explorer: Explorer) -> None:
        self.explorer = explorer

    def monotonic(self) -> float:
        return self.explorer.now


class ModelLock:
    """A re-entrant lock whose acquire is a scheduling point."""

    def __init__(self, explorer: Explorer) -> None:
        self.x = explorer
        self.owner: Actor | None = None
        self.count = 0

    def acquire(self) -> bool:
        me = self.x.current()
        self.x.switch()
        while self.owner is not None and self.owner is not me:
            self.x.block("lock", self)
        self.owner = me
        self.count += 1
        return True

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.owner = None
            self.x.wake(lambda a: a.blocked_on is self, "notified")

    def _is_owned(self) -> bool:
        return self.owner is self.x.current()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()


class ModelCondition:
    """Condition.wait/notify_all on a ModelLock; a wait may end in an injected exception."""

    def __init__(self, explorer: Explorer, lock: ModelLock) -> None:
        self.x, self.lock = explorer, lock

    def wait(self, timeout: float | None = None) -> bool:
        me = self.x.current()
        saved, self.lock.count = self.lock.count, 1
        self.lock.release()
        deadline = None if timeout is None else self.x.now + timeout
        woke = self.x.block("wait", self, deadline)
        while self.lock.owner is not None:
            self.x.block("lock", self.lock)
        self.lock.owner, self.lock.count = me, saved
        if self.x.inject and self.x.rng.random() < self.x.inject:
            raise Injected
        return woke == "notified"

    def notify_all(self) -> None:
        self.x.wake(lambda a: a.state == "wait" and a.blocked_on is self, "notified")

    def __enter__(self) -> bool:
        return self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def random_scripts(rng: random.Random, actors: int, length: int) -> list[list[tuple[str, Any]]]:
    """Scripts mixing named and unnamed sections, nested captures under both policies,
    and cross-thread releases."""
    ops: list[tuple[str, Any]] = [
        *(("enter", c) for c in CALLS),
        ("exit", None),
        ("exit", None),
        ("begin", None),
        ("begin", NARROW),
        ("release", None),
        ("release_other", None),
    ]
    return [[rng.choice(ops) for _ in range(length)] for _ in range(actors)]
