import os

import settings


def test_half_precision():
    # Switches the variable (and, like many tests, never switches it back), then expects the
    # new value. Alone it is the first reader and passes; after any earlier read the frozen
    # configuration refuses with FrozenConfigError (the capsafe plugin turns the guard on).
    os.environ["PLANTED_PRECISION"] = "fp16"
    assert settings.PRECISION.get() == "fp16"
