import settings


def test_turn_debug_on():
    # The polluter: rebinds a module attribute and never restores it.
    settings.DEBUG = True
    assert settings.DEBUG
