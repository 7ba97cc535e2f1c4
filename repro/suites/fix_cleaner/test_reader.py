import state


def test_reads_default_mode():
    # The victim: passes alone, fails after test_switch_to_fast_mode unless reset between.
    assert state.MODE == "default"
