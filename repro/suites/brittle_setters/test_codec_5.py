"""Four state-setters: each loads the table as it needs it."""

import codecs_table


def test_encode_5_1():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_5_2():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_5_3():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_5_4():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_plain_5():
    assert "abc".encode() == b"abc"
