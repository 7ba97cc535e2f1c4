import state


def test_reset_restores_default():
    # The cleaner: run between the polluter and the victim, the victim passes.
    state.reset()
    assert state.MODE == "default"
