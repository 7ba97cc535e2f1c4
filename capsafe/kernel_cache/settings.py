"""Where the cache lives and how big it may grow, from the runtime config."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from capsafe.config import RuntimeConfig, runtime_config
from capsafe.kernel_cache.store import KernelCache


@dataclass(frozen=True)
class CacheSettings:
    directory: Path
    max_bytes: int
    enabled: bool


def default_directory(environ: Mapping[str, str] | None = None) -> Path:
    """$XDG_CACHE_HOME/capsafe/nvrtc (~/.cache on Linux by XDG default), else the platform's."""
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "capsafe" / "nvrtc"
    if sys.platform.startswith("linux"):
        return Path.home() / ".cache" / "capsafe" / "nvrtc"
    import platformdirs  # imported lazily: only needed off Linux

    return Path(platformdirs.user_cache_dir("capsafe", appauthor=False)) / "nvrtc"


def settings_from_env(environ: Mapping[str, str] | None = None) -> CacheSettings:
    """Cache settings from the frozen runtime config (or from `environ`, for tests and tools)."""
    config = runtime_config() if environ is None else RuntimeConfig.from_environ(environ)
    directory = config.kernel_cache_dir or default_directory(environ)
    return CacheSettings(
        directory.expanduser(), config.kernel_cache_max_bytes, config.kernel_cache_enabled
    )


_default: KernelCache | None = None
_default_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache built from the environment on first use."""
    global _default
    with _default_lock:
        if _default is None:
            s = settings_from_env()
            _default = KernelCache(s.directory, s.max_bytes, s.enabled)
        return _default


def reset_after_fork() -> None:
    global _default_lock
    _default_lock = threading.Lock()
