"""What every integration's `install`/`uninstall` share: one installation at a time.

An integration module makes one `Installer` over its `Windows` and a factory that hooks
the framework (returning something with `undo()`), and exposes its methods as the
module's `install`, `uninstall`, `is_installed` and `installed`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from capsafe import driver as _driver
from capsafe.backend import Backend
from capsafe.errors import FrameworkNotInstalled, UsageError

from ._capture_windows import Windows


class Undoable(Protocol):
    def undo(self) -> None: ...


InstallationT = TypeVar("InstallationT", bound=Undoable)


class Installer(Generic[InstallationT]):
    """Install and uninstall one integration; thread-safe, idempotent."""

    def __init__(
        self,
        name: str,
        windows: Windows,
        hook: Callable[[Backend], InstallationT],
        *,
        still_open: str = "capture(s) still open",
        end_first: str = "end the capture",
    ) -> None:
        self.name, self.windows, self.hook = name, windows, hook
        self.still_open, self.end_first = still_open, end_first
        self._lock = threading.Lock()
        self.current: InstallationT | None = None  # the installation, while installed

    def install(self, driver: Backend | None = None) -> bool:
        """Hook the framework through the gate of `driver` (default `driver.get()`);
        False when already installed (nothing changes)."""
        with self._lock:
            if self.current is not None:
                return False
            try:
                self.current = self.hook(driver if driver is not None else _driver.get())
            except ModuleNotFoundError as exc:
                raise FrameworkNotInstalled(
                    f"capsafe.integrations.{self.name}.install(): {exc.name or exc} is not "
                    f"installed in this environment ({exc}); install it, or leave the "
                    f"{self.name} integration out"
                ) from None
            return True

    def uninstall(self) -> bool:
        """Undo `install()`; False when it was not installed. Refused while a capture is open."""
        with self._lock:
            if self.current is None:
                return False
            try:
                self.windows.unhook(self.still_open)
            except RuntimeError as busy:
                raise UsageError(
                    f"capsafe.integrations.{self.name}: {busy}; {self.end_first} before "
                    "uninstalling"
                ) from None
            try:
                self.current.undo()
            except BaseException:
                self.windows.hooked = True  # still installed: hooked begins keep taking the gate
                raise
            self.current = None
            return True

    def is_installed(self) -> bool:
        return self.current is not None

    @contextmanager
    def installed(self, driver: Backend | None = None) -> Iterator[None]:
        """`install()` for the block; undone at its end only if this block installed it."""
        changed = self.install(driver)
        try:
            yield
        finally:
            if changed:
                self.uninstall()
