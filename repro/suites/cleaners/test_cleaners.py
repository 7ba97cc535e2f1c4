"""Each sets the mode back to the default when done: cleaners that hide the victims."""

import state


def test_resets_00():
    state.CACHE["mode"] = "default"


def test_resets_01():
    state.CACHE["mode"] = "default"


def test_resets_02():
    state.CACHE["mode"] = "default"


def test_resets_03():
    state.CACHE["mode"] = "default"


def test_resets_04():
    state.CACHE["mode"] = "default"


def test_resets_05():
    state.CACHE["mode"] = "default"


def test_resets_06():
    state.CACHE["mode"] = "default"


def test_resets_07():
    state.CACHE["mode"] = "default"


def test_resets_08():
    state.CACHE["mode"] = "default"


def test_resets_09():
    state.CACHE["mode"] = "default"


def test_resets_10():
    state.CACHE["mode"] = "default"


def test_resets_11():
    state.CACHE["mode"] = "default"
