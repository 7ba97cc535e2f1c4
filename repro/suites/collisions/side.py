"""Who runs beside this process, and a rendezvous with them that never waits on a clock.

The planted collisions must not hinge on when each process started (on a loaded machine
process starts differ by seconds), yet a process run alone must never wait. So a test
meets only the processes it knows run beside it: the other xdist workers of its run
(xdist starts no test before every worker has collected, and the conftest registers a
worker before it reports its collection), or, in a pair run the sweep starts to try
partners (run id `beside-N`), the one other process of the pair, which may not have
started yet but is sure to come. `meet(step)` returns once each of them has reached the
same step or ended its session: no wall-clock limit; a partner that never comes is a
hang, for the sweep's per-test timeout and the stall watchdog. The two processes of a
pair meet first when they register, so neither is over before the other looks.
"""

import os
import shutil
import tempfile
import time

_group = None  # (directory, peers expected, a pair?) once this process registered
_seen = set()  # peers of a pair seen alive: one that ends afterwards still counts
_config = None


def shared_dir():
    """One directory every process of a sweep sees (a fixed one without the sweep)."""
    return os.environ.get("CAPSAFE_SWEEP_SHARED") or os.path.join(
        tempfile.gettempdir(), "capsafe-collisions-suite"
    )


def register(config):
    global _group, _config
    _config = config
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        name, peers = "xdist-" + worker["testrunuid"], worker["workercount"] - 1
    elif str(config.getoption("capsafe_run_id", None) or "").startswith("beside-"):
        name, peers = "beside", 1
    else:
        return
    directory = os.path.join(shared_dir(), "meet", name)
    mine = os.path.join(directory, str(os.getpid()))
    shutil.rmtree(mine, ignore_errors=True)  # a reused pid's markers
    os.makedirs(mine)
    _group = (directory, peers, name == "beside")
    if name == "beside":
        # Neither process of a pair ends before the other registered: a candidate that
        # never meets anyone would otherwise be over before the test looks, and be taken
        # for a pair tried before this one.
        meet("registered")


def register_once(config):
    if _group is None:
        register(config)


def _mark(step):
    open(os.path.join(_group[0], str(os.getpid()), step), "w").close()


def ended():
    if _group is not None:
        _mark("ended")


def _gone(directory, pid):
    if os.path.exists(os.path.join(directory, pid, "ended")):
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True  # killed before its session ended
    except PermissionError:
        pass
    return False


def meet(step):
    """Wait until each process beside this one has reached `step` or ended."""
    if _config is not None:
        register_once(_config)  # a forked replay learns its run id after collection
    if _group is None:
        return  # nothing runs beside this process
    directory, peers, pair = _group
    _mark(step)
    while True:
        reached = {}
        for pid in os.listdir(directory):
            if pid == str(os.getpid()):
                continue
            gone = _gone(directory, pid)
            if pair and gone and pid not in _seen:
                continue  # a pair tried before this one
            _seen.add(pid)
            reached[pid] = gone or os.path.exists(os.path.join(directory, pid, step))
        if len(reached) >= peers and all(reached.values()):
            return
        time.sleep(0.01)
