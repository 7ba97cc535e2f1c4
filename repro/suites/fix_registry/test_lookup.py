import registry


def test_registry_starts_empty():
    # The victim: passes alone, fails after test_register_plugin in the same process.
    assert registry.PLUGINS == []
