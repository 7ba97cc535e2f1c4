import state


def test_switch_to_fast_mode():
    # The polluter: switches the mode and never back.
    state.configure("fast")
    assert state.MODE == "fast"
