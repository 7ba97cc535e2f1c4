"""The sweep's progress bar, drawn into a fake terminal."""

from __future__ import annotations

import io
import threading

from capsafe_harness.sweep.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def last_frame(terminal: FakeTerminal) -> str:
    """What the terminal shows now: the text after the last carriage return."""
    return terminal.getvalue().rsplit("\r", 1)[-1]


def test_the_total_is_the_work_known_now_and_grows_as_phases_add_work() -> None:
    terminal = FakeTerminal()
    bar = Progress(True, terminal)
    bar.phase("runs")
    bar.add(300)  # 3 runs of 100 tests, known after collection
    bar.update(300)
    assert (bar.done, bar.total) == (300, 300)
    bar.phase("isolation")
    bar.expect(4)  # four alone reruns queued: on the bar before any starts
    assert bar.total == 304
    bar.add(1)  # the first rerun starts its one test: no new work
    assert "capsafe sweep, isolation: 300/304 tests" in last_frame(terminal)
    bar.update(1)
    assert (bar.done, bar.total) == (301, 304)
    bar.phase("searches")
    assert "capsafe sweep, searches: 301/304 tests" in last_frame(terminal)
    bar.release()  # the other three never started (budget): out of the total
    bar.add(20)  # a search replays 20 tests
    assert (bar.done, bar.total) == (301, 321)
    assert "301/321" in last_frame(terminal)
    bar.close()


def test_no_time_left_until_a_tenth_of_the_phase_is_done_nor_in_searches() -> None:
    bar = Progress(True, FakeTerminal())
    bar.phase("runs")
    bar.add(1000)
    bar.update(50)  # the first tests of run 1 after a slow start-up: no estimate yet
    assert bar.time_left() is None
    bar.update(150)
    left = bar.time_left()
    assert left is not None and left >= 0
    bar.phase("searches")  # its work is found replay by replay: never an estimate
    bar.add(10)
    bar.update(10)
    assert bar.time_left() is None
    bar.close()


def test_off_when_stderr_is_not_a_terminal() -> None:
    pipe = io.StringIO()  # a CI log
    bar = Progress(True, pipe)
    bar.phase("runs")
    bar.add(10)
    bar.update(10)
    bar.close()
    assert not bar.enabled and pipe.getvalue() == ""


def test_off_with_no_progress_on_a_terminal() -> None:
    terminal = FakeTerminal()
    bar = Progress(False, terminal)
    bar.add(10)
    bar.update(10)
    bar.close()
    assert terminal.getvalue() == ""


def test_a_bar_starts_no_thread() -> None:
    """tqdm's monitor thread outlived a sweep made in-process by up to ten seconds, and the
    fork server's checks, run next in the same process, named it as a live thread."""
    before = set(threading.enumerate())
    for enabled in (False, True):
        bar = Progress(enabled, stream=FakeTerminal())
        bar.expect(3)
        bar.update(1)
        bar.close()
    assert set(threading.enumerate()) <= before
