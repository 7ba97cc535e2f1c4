"""The polluter: lowers the process-wide decimal precision and never restores it."""

import decimal


def test_lower_precision():
    decimal.getcontext().prec = 4
    assert decimal.Decimal(2) / decimal.Decimal(3) == decimal.Decimal("0.6667")


def test_config_filler():
    assert decimal.Decimal("1.5") + decimal.Decimal("1.5") == 3
