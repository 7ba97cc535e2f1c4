import fcntl
import os
from pathlib import Path


def _invocation() -> int:
    """How many times this test has run in this sweep (counted in the sweep's shared dir).

    Locked: the sweep runs isolation reruns in parallel, and two reruns that both
    append before either reads would both count the same number.
    """
    counter = Path(os.environ["CAPSAFE_SWEEP_SHARED"]) / "coin-flips"
    with counter.open("a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("x")
        f.seek(0)
        return len(f.read())


def test_coin_flip():
    # Nondeterministic as seen from the test: the outcome depends on nothing it
    # controls. Under `capsafe sweep` it fails on every other invocation, so the
    # answer key holds in every sweep; run alone with plain pytest it is a real
    # coin flip (os.urandom: `random` is reseeded per test by the plugin).
    if "CAPSAFE_SWEEP_SHARED" in os.environ:
        assert _invocation() % 2 == 1
    else:
        assert os.urandom(1)[0] < 128
