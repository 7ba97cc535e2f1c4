import logging


def test_app_logger_inherits_its_level():
    # The victim: passes alone, fails after test_quiet_the_app_logger unless reset between.
    assert logging.getLogger("fix_cleaner.app").level == logging.NOTSET
