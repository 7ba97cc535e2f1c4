import settings


def test_release_build_has_debug_off():
    # The victim: passes alone, fails after test_turn_debug_on in the same process.
    assert settings.DEBUG is False
