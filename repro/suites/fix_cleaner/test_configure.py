import logging


def test_quiet_the_app_logger():
    # The polluter: raises a logger's level through a method call and never sets it back
    # (no assignment shows what to restore).
    logging.getLogger("fix_cleaner.app").setLevel(logging.ERROR)
    assert not logging.getLogger("fix_cleaner.app").isEnabledFor(logging.INFO)
