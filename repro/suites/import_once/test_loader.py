import sys

import pytest

import plugins


def test_load_plugin():
    # The victim, python-fs's test_addpath: its plugin is not importable until its
    # directory is on sys.path, so it cannot run twice in one process (the second time
    # the module is imported already). It fails when another worker's cleaner removes
    # the directory between the write and the import.
    directory = plugins.write()
    with pytest.raises(ImportError):
        import planted_plugin  # noqa: F401
    sys.path.insert(0, directory)
    plugins.before_import()
    import planted_plugin

    assert planted_plugin.NAME == "planted"
