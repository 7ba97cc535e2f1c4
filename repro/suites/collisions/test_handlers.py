import handlers


def test_add_handler():
    # The polluter: adds a handler and never removes it.
    handlers.add("audit")
    assert "audit" in handlers.HANDLERS
