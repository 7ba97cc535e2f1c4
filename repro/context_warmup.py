"""A device test passes only after another test made the primary context current on its thread.

The driver's current context is per thread. A test that calls the driver
without binding a context works only if an earlier test on the same worker
thread happened to retain the primary context and make it current (a "warm-up"
test, a fixture of another module). Alone, or after a reshuffle, it fails with
CUDA_ERROR_INVALID_CONTEXT: a brittle test and its state-setter.

Each scenario below runs its tests in order on a fresh thread, like one pytest
worker running a sequence:

1. the brittle test alone: fails with CUDA_ERROR_INVALID_CONTEXT;
2. the state-setter, then the brittle test: passes;
3. the same test written with capsafe.device(), alone: passes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from capsafe.backend import Backend
from capsafe.errors import CudaError

from .cli import finish, reproducer_parser, run_main, select_backend

PATTERN = 0x5A
SIZE = 4096


def _exercise(backend: Backend) -> None:
    """The body every version of the test shares: allocate, fill, read back, check, free."""
    ptr = backend.mem_alloc(SIZE)
    try:
        backend.memset_d8(ptr, PATTERN, SIZE)
        host = bytearray(SIZE)
        backend.memcpy_dtoh(host, ptr, SIZE)
        assert host == bytes([PATTERN]) * SIZE, "read back the wrong bytes"
    finally:
        backend.mem_free(ptr)


def test_brittle() -> None:
    """Uses the process-wide driver and trusts that some context is current."""
    from capsafe import driver

    _exercise(driver.get())


def test_warms_the_context() -> None:
    """The state-setter: retains device 0's primary context and makes it current here."""
    from capsafe import driver

    backend = driver.get()
    backend.ctx_set_current(backend.primary_ctx_retain(backend.device_get(0)))


def test_with_capsafe_device() -> None:
    """The brittle test fixed: capsafe.device() binds the retained context on this thread."""
    import capsafe

    _exercise(capsafe.device(0).backend)


@dataclass(frozen=True)
class Outcome:
    test: str
    passed: bool
    error: str | None


def run_on_fresh_thread(tests: list[Callable[[], None]]) -> list[Outcome]:
    """Run the tests in order on one new thread, as one worker would, and report each."""
    outcomes: list[Outcome] = []

    def worker() -> None:
        for test in tests:
            try:
                test()
            except (CudaError, AssertionError) as exc:
                outcomes.append(Outcome(test.__name__, False, str(exc)))
            else:
                outcomes.append(Outcome(test.__name__, True, None))

    thread = threading.Thread(target=worker, name="context-warmup-worker")
    thread.start()
    thread.join(timeout=120)
    if thread.is_alive():
        raise TimeoutError("a scenario did not finish within 120 s")
    return outcomes


SCENARIOS = {
    "brittle test alone": [test_brittle],
    "state-setter, then brittle test": [test_warms_the_context, test_brittle],
    "capsafe.device() version alone": [test_with_capsafe_device],
}


def main(argv: list[str] | None = None) -> int:
    args = reproducer_parser(__doc__, __spec__.name).parse_args(argv)
    select_backend(args.backend)
    from capsafe import driver

    print(f"backend: {driver.backend_choice()}\n")
    results = {}
    for number, (scenario, tests) in enumerate(SCENARIOS.items(), start=1):
        outcomes = run_on_fresh_thread(tests)
        results[scenario] = outcomes
        print(f"{number}. {scenario} (fresh thread):")
        for outcome in outcomes:
            verdict = "PASS" if outcome.passed else f"FAIL  {outcome.error}"
            print(f"   {outcome.test:<26} {verdict}")

    alone, warmed, fixed = (results[name][-1] for name in SCENARIOS)
    ok = (
        not alone.passed
        and "CUDA_ERROR_INVALID_CONTEXT" in (alone.error or "")
        and warmed.passed
        and fixed.passed
    )
    print(
        "\nverdict: "
        + (
            "the brittle test depends on its state-setter; capsafe.device() removes that"
            if ok
            else "NOT SHOWN (see above)"
        )
    )
    return finish(
        {
            "reproducer": "context_warmup",
            "backend": driver.backend_choice(),
            "scenarios": {k: [asdict(o) for o in v] for k, v in results.items()},
        },
        args.json,
        ok,
    )


if __name__ == "__main__":
    sys.exit(run_main(main, "capsafe_repro.context_warmup"))
