import plugins


def test_clear_plugins():
    # The partner: clears the shared plugin directory; passes wherever it runs.
    plugins.clear()
