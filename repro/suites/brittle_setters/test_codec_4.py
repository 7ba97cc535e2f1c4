"""Four state-setters: each loads the table as it needs it."""

import codecs_table


def test_encode_4_1():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_4_2():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_4_3():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_4_4():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_plain_4():
    assert "abc".encode() == b"abc"
