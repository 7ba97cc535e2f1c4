"""One warning per process for cache problems; the rest at debug level."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("capsafe.kernel_cache")


class OnceWarner:
    """Logs the first cache problem as a warning and later ones at debug level.

    logging, not warnings.warn: under `-W error` or pytest's filterwarnings=error
    a warning becomes an exception, which would make the cache load-bearing.
    """

    def __init__(self, suffix: str = "; compiling without the cache") -> None:
        self._lock = threading.Lock()
        self.warned = False
        self.suffix = suffix

    def __call__(self, message: str) -> None:
        with self._lock:
            first, self.warned = not self.warned, True
        if first:
            log.warning("capsafe kernel cache: %s%s", message, self.suffix)
        else:
            log.debug("capsafe kernel cache: %s", message)

    def reset_after_fork(self) -> None:
        self._lock = threading.Lock()


PROCESS_WARNER = OnceWarner()
