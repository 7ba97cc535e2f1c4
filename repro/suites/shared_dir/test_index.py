import dirs


def setup_function(function):
    dirs.make()


def test_index_name():
    # The victim: its body touches no file; its setup_function fails when another
    # worker's teardown_module removes the directory between making and writing.
    assert "index.txt".endswith(".txt")
