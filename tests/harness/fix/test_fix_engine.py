"""The fix engine end to end on tiny planted suites, with a real replay (a fresh pytest process
per sequence, fix_replay.py): each patch it returns is applied to the suite with `git apply`
and replayed again here, independently of the engine's own verification. Each costs about ten
pytest processes: one of each strategy (idiom, state-setter, cleaner, none) is in the fast
tier, the other idioms and checks in the slow one."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest
from fix_replay import Replay, write_suite

from capsafe_harness.fix.case import FixCase, VerifiedPatch, find_patch

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="applies patches with git")

REGISTRY = {
    "registry.py": "PLUGINS = []\n\n\ndef register(name):\n    PLUGINS.append(name)\n",
    "test_register.py": (
        "import registry\n\n\ndef test_register_plugin():\n"
        '    registry.register("fast")\n    assert "fast" in registry.PLUGINS\n'
    ),
    "test_lookup.py": (
        "import registry\n\n\ndef test_registry_starts_empty():\n"
        "    assert registry.PLUGINS == []\n\n\ndef test_other():\n    assert True\n"
    ),
}
STATE = "CACHE = {'mode': 'default'}\n"
ALIASED_POLLUTER = (  # through a local name: no idiom reads it, only a cleaner helps
    "import state\n\n\ndef test_switch():\n    c = state.CACHE\n    c['mode'] = 'fast'\n"
)


def digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def fix(
    tmp_path: Path, files: Mapping[str, str], case: FixCase, *, times: int = 2
) -> tuple[VerifiedPatch | None, Replay, Path]:
    """find_patch on a suite planted from `files`, checking the suite itself is never written."""
    root = write_suite(tmp_path / "suite", files)
    before = digest(root)
    replay = Replay()
    patch = find_patch(case, root, replay, times=times, budget_left=lambda: True)
    assert digest(root) == before
    assert replay.calls and all(r != root for r, _ in replay.calls)  # only scratch copies
    return patch, replay, root


def applied(root: Path, patch: VerifiedPatch) -> None:
    """Apply the diff as a user would, after checking it is against the file as it is."""
    assert hashlib.sha256((root / patch.path).read_bytes()).hexdigest() == patch.sha256_before
    subprocess.run(["git", "apply", "-p1", "-"], cwd=root, input=patch.diff, text=True, check=True)


def passes(root: Path, *sequence: str) -> bool:
    return Replay()(root, sequence).get(sequence[-1]) is False


def test_a_registry_polluter_restores_its_registry(tmp_path: Path) -> None:
    case = FixCase(
        "test_lookup.py::test_registry_starts_empty",
        "order-dependent",
        ("test_register.py::test_register_plugin",),
    )
    patch, _, root = fix(tmp_path, REGISTRY, case, times=3)
    assert patch is not None and patch.source == "idiom" and patch.path == "test_register.py"
    assert (
        '+    monkeypatch.setattr(registry, "PLUGINS", copy.copy(registry.PLUGINS))' in patch.diff
    )
    assert patch.evidence["passes"] == 3 and patch.evidence["alone_passes"] == 1
    assert not passes(root, *case.causes, case.victim)
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)
    assert passes(root, *case.causes)  # the polluter still passes itself


@pytest.mark.slow
def test_an_environment_leak_becomes_monkeypatch_setenv(tmp_path: Path) -> None:
    files = {
        "test_env.py": (
            "import os\n\n\ndef test_sets_mode():\n    os.environ['APP_MODE'] = 'fast'\n"
            "    assert os.environ['APP_MODE'] == 'fast'\n"
        ),
        "test_read.py": (
            "import os\n\n\ndef test_default_mode():\n"
            "    assert os.environ.get('APP_MODE', 'default') == 'default'\n"
        ),
    }
    case = FixCase(
        "test_read.py::test_default_mode",
        "order-dependent",
        ("test_env.py::test_sets_mode",),
        env_leaks={"APP_MODE": (None, "fast")},
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "idiom"
    assert "+    monkeypatch.setenv('APP_MODE', 'fast')" in patch.diff
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


@pytest.mark.slow
def test_a_module_attribute_in_a_testcase_is_patched_and_stopped_at_cleanup(tmp_path: Path) -> None:
    files = {
        "settings.py": "PRECISION = 'fp32'\n",
        "test_flip.py": (
            "import unittest\n\nimport settings\n\n\nclass TestFlip(unittest.TestCase):\n"
            "    def test_half(self):\n        settings.PRECISION = 'fp16'\n"
            "        self.assertEqual(settings.PRECISION, 'fp16')\n"
        ),
        "test_read.py": (
            "import settings\n\n\ndef test_full():\n    assert settings.PRECISION == 'fp32'\n"
        ),
    }
    case = FixCase(
        "test_read.py::test_full", "order-dependent", ("test_flip.py::TestFlip::test_half",)
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "idiom"
    assert "+        self.addCleanup(unittest.mock.patch.stopall)" in patch.diff
    assert "unittest.mock.patch.object(settings, 'PRECISION', 'fp16', create=True).start()" in (
        patch.diff
    )
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


def test_a_brittle_test_gets_the_one_statement_of_its_state_setter_it_needs(tmp_path: Path) -> None:
    files = {
        "units.py": "FACTORS = {}\n\n\ndef load_metric():\n    FACTORS.update({'km': 1000.0})\n",
        "test_load.py": (
            "import units\n\n\ndef test_load():\n    x = 3\n    units.load_metric()\n"
            "    assert units.FACTORS['km'] == 1000.0\n    assert x == 3\n"
        ),
        "test_convert.py": (
            "import units\n\n\ndef test_km():\n    assert 3 * units.FACTORS['km'] == 3000.0\n"
        ),
    }
    case = FixCase("test_convert.py::test_km", "brittle", ("test_load.py::test_load",))
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "state-setter" and patch.path == "test_convert.py"
    added = [line for line in patch.diff.splitlines() if line.startswith("+ ") and "#" not in line]
    assert added == ["+    units.load_metric()"]  # of 4 statements, ddmin kept the one needed
    assert patch.evidence["statements"] == 4 and patch.evidence["kept"] == 1
    assert not passes(root, case.victim)
    applied(root, patch)
    assert passes(root, case.victim)


def test_a_cleaner_patch_after_a_rewrite_that_does_not_fix_is_rejected(tmp_path: Path) -> None:
    files = {
        "state.py": STATE + "\n\ndef reset():\n    CACHE['mode'] = 'default'\n",
        "test_configure.py": (
            "import os\n\nimport state\n\n\ndef test_switch():\n"
            "    os.environ['UNRELATED'] = '1'  # rewritten first: it does not fix the victim\n"
            "    open('report.csv', 'w').close()  # noted: a fixed path\n"
            "    cache = state.CACHE\n    cache['mode'] = 'fast'\n"
        ),
        "test_clean.py": (
            "from state import reset\n\n\ndef test_resets(tmp_path):\n    n = 1\n"
            "    (tmp_path / 'x').write_text('x')\n    reset()\n    assert n == 1\n"
        ),
        "test_read.py": (
            'import state\n\n\ndef test_reads_default():\n    """Doc."""\n'
            "    assert state.CACHE['mode'] == 'default'\n"
        ),
    }
    case = FixCase(
        "test_read.py::test_reads_default",
        "order-dependent",
        ("test_configure.py::test_switch",),
        cleaners=("test_clean.py::test_resets",),
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "cleaner" and patch.path == "test_read.py"
    tried = patch.evidence["tried_first"]
    assert isinstance(tried, list) and any("setenv" in t for t in tried)
    notes = patch.evidence["notes"]
    assert isinstance(notes, list) and any("'report.csv'" in n and "tmp_path" in n for n in notes)
    added = [line for line in patch.diff.splitlines() if line.startswith("+") and "+++" not in line]
    assert added == [
        "+from state import reset",
        "+    # capsafe fix: taken from the cleaner test_clean.py::test_resets",
        "+    reset()",
    ]
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


@pytest.mark.slow
def test_a_cleaner_that_breaks_the_victims_module_is_passed_over(tmp_path: Path) -> None:
    files = {
        "state.py": STATE,
        "test_configure.py": ALIASED_POLLUTER,
        "test_clean.py": (
            "import state\n\n\ndef test_wipes():\n    state.CACHE.clear()\n\n\n"
            "def test_resets():\n    state.CACHE['mode'] = 'default'\n"
        ),
        "test_read.py": (
            "import state\n\n\ndef test_reads_default():\n"
            "    assert state.CACHE.get('mode', 'default') == 'default'\n\n\n"
            "def test_has_mode():\n    assert 'mode' in state.CACHE\n"
        ),
    }
    case = FixCase(
        "test_read.py::test_reads_default",
        "order-dependent",
        ("test_configure.py::test_switch",),
        cleaners=("test_clean.py::test_wipes", "test_clean.py::test_resets"),
    )
    patch, _, _ = fix(tmp_path, files, case)
    assert patch is not None and "test_resets" in patch.how
    assert "state.CACHE.clear()" not in patch.diff
    tried = patch.evidence["tried_first"]
    assert isinstance(tried, list) and any("test_wipes" in t for t in tried)


def test_no_patch_when_nothing_verifies_and_none_without_budget(tmp_path: Path) -> None:
    files = {
        "state.py": STATE,
        "test_configure.py": ALIASED_POLLUTER,
        "test_clean.py": "def test_not_a_cleaner():\n    assert 1 + 1 == 2\n",
        "test_read.py": (
            "import state\n\n\ndef test_reads_default():\n"
            "    assert state.CACHE['mode'] == 'default'\n"
        ),
    }
    case = FixCase(
        "test_read.py::test_reads_default",
        "order-dependent",
        ("test_configure.py::test_switch",),
        cleaners=("test_clean.py::test_not_a_cleaner",),
    )
    patch, replay, _ = fix(tmp_path, files, case)
    assert patch is None
    assert len(replay.calls) == 2  # reproduced once, the cleaner's statements tried once
    root = tmp_path / "suite"
    calls = Replay()
    assert find_patch(case, root, calls, times=2, budget_left=lambda: False) is None
    assert calls.calls == []


@pytest.mark.slow
def test_the_module_check_replays_the_collected_ids_or_says_it_could_not(tmp_path: Path) -> None:
    files = {
        **REGISTRY,
        "conftest.py": (
            "import pytest\n\n\n@pytest.fixture(params=[1, 2])\ndef size(request):\n"
            "    return request.param\n"
        ),
        "test_lookup.py": REGISTRY["test_lookup.py"]
        + "\n\ndef test_sized(size):\n    assert size\n",
    }
    case = FixCase(
        "test_lookup.py::test_registry_starts_empty",
        "order-dependent",
        ("test_register.py::test_register_plugin",),
    )
    # From the source, test_lookup.py::test_sized is an id no collection has (it is
    # test_sized[1] and [2]): the replay refuses the whole list, so only the case's own run.
    patch, _, _ = fix(tmp_path, files, case)
    assert patch is not None
    module = patch.evidence["module test_lookup.py"]
    assert isinstance(module, dict) and module["tests"].startswith("the case's own tests")
    assert module["ran"] == 1
    collected = (
        "test_lookup.py::test_registry_starts_empty",
        "test_lookup.py::test_other",
        "test_lookup.py::test_sized[1]",
        "test_lookup.py::test_sized[2]",
        "test_register.py::test_register_plugin",
    )
    root = tmp_path / "suite"
    again = find_patch(
        FixCase(case.victim, case.kind, case.causes, collected=collected),
        root,
        Replay(),
        times=1,
        budget_left=lambda: True,
    )
    assert again is not None and again.diff == patch.diff
    module = again.evidence["module test_lookup.py"]
    assert isinstance(module, dict) and module["tests"] == "collected" and module["ran"] == 4


@pytest.mark.slow
def test_a_file_left_in_a_session_directory_is_removed_by_its_writer(tmp_path: Path) -> None:
    files = {
        "conftest.py": (
            "import pytest\n\n\n@pytest.fixture(scope='session')\n"
            "def export_dir(tmp_path_factory):\n    return tmp_path_factory.mktemp('exports')\n"
        ),
        "test_export.py": (
            "def test_export(export_dir):\n    (export_dir / 'r.csv').write_text('x')\n"
        ),
        "test_scan.py": (
            "def test_starts_empty(export_dir):\n    assert list(export_dir.iterdir()) == []\n"
        ),
    }
    case = FixCase(
        "test_scan.py::test_starts_empty", "order-dependent", ("test_export.py::test_export",)
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "idiom" and patch.path == "test_export.py"
    assert "+def test_export(export_dir, request):" in patch.diff
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


@pytest.mark.slow
def test_a_testcase_victim_takes_a_testcase_cleaners_setup_and_self(tmp_path: Path) -> None:
    files = {
        "state.py": STATE,
        "test_configure.py": ALIASED_POLLUTER,
        "test_clean.py": (
            "import unittest\n\nimport state\n\n\nclass TestClean(unittest.TestCase):\n"
            "    def setUp(self):\n        self.default = 'default'\n        self.unused = 1\n\n"
            "    def test_resets(self):\n        state.CACHE['mode'] = self.default\n"
            "        self.assertTrue(self.unused)\n"
        ),
        "test_read.py": (
            "import unittest\n\nimport state\n\n\nclass TestRead(unittest.TestCase):\n"
            "    def test_reads_default(self):\n"
            "        self.assertEqual(state.CACHE['mode'], 'default')\n"
        ),
    }
    case = FixCase(
        "test_read.py::TestRead::test_reads_default",
        "order-dependent",
        ("test_configure.py::test_switch",),
        cleaners=("test_clean.py::TestClean::test_resets",),
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "cleaner"
    added = [line for line in patch.diff.splitlines() if line.startswith("+ ") and "#" not in line]
    assert added == [
        "+        self.default = 'default'",
        "+        state.CACHE['mode'] = self.default",
    ]
    assert patch.evidence["statements"] == 4 and patch.evidence["kept"] == 2
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


@pytest.mark.slow
def test_a_brittle_test_deleting_what_its_setter_set_gets_delenv_raising_false(
    tmp_path: Path,
) -> None:
    files = {
        "test_setter.py": (
            "import os\n\n\ndef test_sets():\n    os.environ['CONF_FILE'] = 'a.yaml'\n"
            "    assert os.environ['CONF_FILE']\n"
        ),
        "test_brittle.py": (
            "import os\n\n\ndef test_without_conf():\n    del os.environ['CONF_FILE']\n"
            "    assert os.environ.get('CONF_FILE') is None\n"
        ),
    }
    case = FixCase("test_brittle.py::test_without_conf", "brittle", ("test_setter.py::test_sets",))
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "idiom" and patch.path == "test_brittle.py"
    assert "+    monkeypatch.delenv('CONF_FILE', raising=False)" in patch.diff
    assert not passes(root, case.victim)
    applied(root, patch)
    assert passes(root, case.victim)


@pytest.mark.slow
def test_a_polluter_failing_before_its_stop_gets_the_stop_in_a_finally(tmp_path: Path) -> None:
    files = {
        "clock.py": (
            "FROZEN = []\n\n\nclass Freezer:\n    def start(self):\n        FROZEN.append(1)\n\n"
            "    def stop(self):\n        FROZEN.pop()\n"
        ),
        "test_freeze.py": (
            "import clock\n\n\ndef test_frozen_and_broken():\n    freezer = clock.Freezer()\n"
            "    freezer.start()\n    assert not clock.FROZEN  # fails: the stop never runs\n"
            "    freezer.stop()\n"
        ),
        "test_now.py": "import clock\n\n\ndef test_not_frozen():\n    assert clock.FROZEN == []\n",
    }
    case = FixCase(
        "test_now.py::test_not_frozen",
        "order-dependent",
        ("test_freeze.py::test_frozen_and_broken",),
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "idiom" and "finally:" in patch.diff
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


@pytest.mark.slow
def test_a_reload_in_a_polluter_is_undone_after_it(tmp_path: Path) -> None:
    files = {
        "api.py": "class Fake:\n    pass\n",
        "test_reload.py": (
            "import importlib\n\nimport api\n\n\ndef test_reloads():\n    importlib.reload(api)\n"
        ),
        "test_identity.py": (
            "import api\nfrom api import Fake\n\n\ndef test_same_class():\n"
            "    assert api.Fake is Fake\n"
        ),
    }
    case = FixCase(
        "test_identity.py::test_same_class", "order-dependent", ("test_reload.py::test_reloads",)
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "idiom" and "api.__dict__.update" in patch.diff
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


@pytest.mark.slow
def test_a_mock_patched_polluter_takes_monkeypatch_after_its_mock(tmp_path: Path) -> None:
    files = {
        "settings.py": "LEVEL = 'debug'\n",
        "test_quiet.py": (
            "import os\nfrom unittest import mock\n\nimport settings\n\n\n"
            "@mock.patch('os.getcwd')\ndef test_quiet(getcwd):\n    getcwd.return_value = '/x'\n"
            "    settings.LEVEL = 'quiet'\n    assert os.getcwd() == '/x'\n"
        ),
        "test_level.py": (
            "import settings\n\n\ndef test_debug():\n    assert settings.LEVEL == 'debug'\n"
        ),
    }
    case = FixCase("test_level.py::test_debug", "order-dependent", ("test_quiet.py::test_quiet",))
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and "+def test_quiet(getcwd, monkeypatch):" in patch.diff
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)


@pytest.mark.slow
def test_a_cleaners_helper_comes_along_as_an_import(tmp_path: Path) -> None:
    files = {
        "state.py": STATE,
        "test_configure.py": ALIASED_POLLUTER,
        "test_clean.py": (
            "import state\n\n\ndef reset():\n    state.CACHE['mode'] = 'default'\n\n\n"
            "def test_resets():\n    reset()\n"
        ),
        "test_read.py": (
            "import state\n\n\ndef test_reads_default():\n"
            "    assert state.CACHE['mode'] == 'default'\n"
        ),
    }
    case = FixCase(
        "test_read.py::test_reads_default",
        "order-dependent",
        ("test_configure.py::test_switch",),
        cleaners=("test_clean.py::test_resets",),
    )
    patch, _, root = fix(tmp_path, files, case)
    assert patch is not None and patch.source == "cleaner"
    assert "+from test_clean import reset" in patch.diff and "+    reset()" in patch.diff
    applied(root, patch)
    assert passes(root, *case.causes, case.victim)
