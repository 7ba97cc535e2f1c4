import codecs_table


def test_lookup_without_loading():
    # Brittle: never loads the table itself; any of twenty setters before it hides that.
    assert codecs_table.TABLE["latin1"] == "ISO-8859-1"


def test_lookup_filler():
    assert "é".encode("latin-1") == b"\xe9"
