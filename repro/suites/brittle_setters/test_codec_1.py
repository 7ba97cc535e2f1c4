"""Four state-setters: each loads the table as it needs it."""

import codecs_table


def test_encode_1_1():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_1_2():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_1_3():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_encode_1_4():
    codecs_table.ensure_loaded()
    assert codecs_table.TABLE["utf8"] == "UTF-8"


def test_plain_1():
    assert "abc".encode() == b"abc"
