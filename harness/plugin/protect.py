"""`--capsafe-protect=cupy,cuda_core,torch`: capsafe's framework integrations in every test process.

Each named integration (`capsafe.integrations.<name>`) is installed once per
test process (each xdist worker; not the controller, which runs no tests), at
session start, before any test module is collected. After each test, a capture
window the test began through a hooked framework call and never ended is
released with a warning: otherwise its gate stays closed for the rest of the
session, and every later gated call waits for a capture that is gone.

capsafe is imported only when the option is given.

What a sweep makes of the protected reruns is report/protection.py's.
"""

from __future__ import annotations

from collections.abc import Generator
from types import ModuleType

import pytest

OPTION = "--capsafe-protect"
PLUGIN_NAME = "capsafe-protect"


def add_option(group: pytest.OptionGroup) -> None:
    group.addoption(
        OPTION,
        metavar="NAME[,NAME...]",
        help="install capsafe's integrations (cupy, cuda_core, torch) in every test process, so "
        "the frameworks' allocations and captures go through the capture gate",
    )


def parse(value: str | None) -> tuple[str, ...]:
    """The integration names in `value` (comma-separated, duplicates dropped), validated."""
    if not value:
        return ()
    from capsafe.integrations import NAMES

    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise pytest.UsageError(
            f"{OPTION}: unknown integration {(unknown or [value])[0]!r}; "
            f"give a comma-separated list of: {', '.join(NAMES)}"
        )
    return names


def configure(config: pytest.Config) -> None:
    """Validate the option and register the per-process installer when it names anything."""
    names = parse(config.option.capsafe_protect)
    if names:
        config.pluginmanager.register(Protection(config, names), PLUGIN_NAME)


class Protection:
    """Installs the integrations at session start; releases windows a test left open."""

    def __init__(self, config: pytest.Config, names: tuple[str, ...]) -> None:
        self.config = config
        self.names = names
        self.modules: list[ModuleType] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        if self.config.pluginmanager.has_plugin("dsession"):
            return  # the xdist controller: tests run in the workers, which install for themselves
        from capsafe.errors import CapsafeError
        from capsafe.integrations import module

        for name in self.names:
            integration = module(name)
            try:
                integration.install()
            except (ImportError, CapsafeError) as exc:
                raise pytest.UsageError(
                    f"{OPTION}={name}: cannot install ({type(exc).__name__}: {exc})"
                ) from None
            self.modules.append(integration)

    def pytest_report_header(self, config: pytest.Config) -> str:
        return f"capsafe: protect={','.join(self.names)}"

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            for integration in self.modules:
                for label in integration.windows.release_all():
                    item.warn(
                        pytest.PytestWarning(
                            f"capsafe: the test left a capture open ({label}); "
                            "its hold on the capture gate was released"
                        )
                    )


#: Each integration's framework, as the suite's interpreter finds it (`capsafe sweep --protect
#: auto` installs the integrations whose framework is there).
FRAMEWORKS = {"cupy": "cupy", "cuda_core": "cuda.core", "torch": "torch"}
