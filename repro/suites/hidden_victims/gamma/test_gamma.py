"""Package gamma: a class whose teardown restores the precision (cleaners: run between the
polluter and a victim, they hide it), then victims that expect the default precision."""

import decimal

THIRD = decimal.Decimal("0.3333333333333333333333333333")  # 1/3 at the default 28 digits


class TestRounding:
    def teardown_method(self):
        decimal.getcontext().prec = 28  # the setting back to its default

    def test_round_half_even(self):
        assert round(decimal.Decimal("2.5")) == 2

    def test_quantize(self):
        assert decimal.Decimal("1.005").quantize(decimal.Decimal("0.01")) >= 1

    def test_compare(self):
        assert decimal.Decimal("0.1") < decimal.Decimal("0.2")


def test_gamma_third():
    assert decimal.Decimal(1) / decimal.Decimal(3) == THIRD


def test_gamma_sum_of_thirds():
    third = decimal.Decimal(1) / decimal.Decimal(3)
    assert third * 3 == decimal.Decimal("0.9999999999999999999999999999")


def test_gamma_filler():
    assert decimal.Decimal(7).sqrt() > 2
