import logging


def test_logger_level_can_be_reset():
    # The cleaner: run between the polluter and the victim, the victim passes.
    logging.getLogger("fix_cleaner.app").setLevel(logging.NOTSET)
    assert logging.getLogger("fix_cleaner.app").level == logging.NOTSET
