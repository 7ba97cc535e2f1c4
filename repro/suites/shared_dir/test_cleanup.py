import time

import dirs


def teardown_module(module):
    dirs.remove()


def test_cleanup_name():
    # The partner: passes wherever it runs; its module's teardown removes the directory.
    time.sleep(0.05)
    assert "test_dir".startswith("test")
