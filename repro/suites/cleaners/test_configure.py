import state


def test_switch_to_fast_mode():
    state.CACHE["mode"] = "fast"  # and never back: the polluter
    assert state.CACHE["mode"] == "fast"
