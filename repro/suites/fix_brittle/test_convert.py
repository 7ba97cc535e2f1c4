import units


def test_km_to_m():
    # Brittle: never loads the table itself, so it fails alone and passes after the setter.
    assert 3 * units.FACTORS["km"] == 3000.0
