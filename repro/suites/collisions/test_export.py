import contextlib
import os

from side import meet, shared_dir


def _export(me):
    # Both write one report into the same fixed directory, as tests that share a
    # temporary directory across xdist workers do: beside each other they collide.
    outbox = os.path.join(shared_dir(), "outbox")
    os.makedirs(outbox, exist_ok=True)
    report = os.path.join(outbox, "report.txt")
    meet("started")  # both are in the test before either writes
    try:
        with open(report, "a") as f:
            f.write(me)
        meet("wrote")
        with open(report) as f:
            assert f.read() == me
    finally:
        meet("read")  # nobody removes it while the other still reads it
        with contextlib.suppress(FileNotFoundError):
            os.remove(report)


def test_export_csv():
    _export("csv")


def test_export_json():
    _export("json")
