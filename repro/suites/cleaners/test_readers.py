"""Each reads the mode and expects the default: a victim of test_switch_to_fast_mode."""

import state


def test_reads_default_00():
    assert state.CACHE["mode"] == "default"


def test_reads_default_01():
    assert state.CACHE["mode"] == "default"


def test_reads_default_02():
    assert state.CACHE["mode"] == "default"


def test_reads_default_03():
    assert state.CACHE["mode"] == "default"


def test_reads_default_04():
    assert state.CACHE["mode"] == "default"


def test_reads_default_05():
    assert state.CACHE["mode"] == "default"


def test_reads_default_06():
    assert state.CACHE["mode"] == "default"


def test_reads_default_07():
    assert state.CACHE["mode"] == "default"


def test_reads_default_08():
    assert state.CACHE["mode"] == "default"


def test_reads_default_09():
    assert state.CACHE["mode"] == "default"


def test_reads_default_10():
    assert state.CACHE["mode"] == "default"


def test_reads_default_11():
    assert state.CACHE["mode"] == "default"
