import registry


def test_register_plugin():
    # The polluter: registers and never unregisters.
    registry.register("fast-path")
    assert "fast-path" in registry.PLUGINS
