import handlers


def test_no_handlers_by_default():
    # The victim: passes alone, fails after test_add_handler in the same process.
    assert handlers.HANDLERS == []
