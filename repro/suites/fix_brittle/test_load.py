import units


def test_load_metric_table():
    # The state-setter: fills the table the brittle test silently relies on.
    units.load_metric()
    assert units.FACTORS["km"] == 1000.0
