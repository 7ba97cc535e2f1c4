"""The fix engine's syntax-tree moves, without running a test: finding a test by node id,
the edits a patch is made of, what a donor's statements can carry into a victim, and the
idiomatic rewrites read off a polluter's source."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import pytest

from capsafe_harness.fix.delta import ddmin
from capsafe_harness.fix.edit import Import as Needed
from capsafe_harness.fix.edit import add_imports, add_params, names_used, prepend
from capsafe_harness.fix.idioms import rewrite_brittle, rewrites
from capsafe_harness.fix.locate import Found, find, module_tests, setups, site_of
from capsafe_harness.fix.transplant import donation, implant, importable


def parse(source: str) -> cst.Module:
    return cst.parse_module(textwrap.dedent(source))


def found(source: str, nodeid: str) -> Found:
    hit = find(parse(source), site_of(nodeid))
    assert hit is not None, nodeid
    return hit


UNITTEST = """
    import unittest

    class TestCache(unittest.TestCase):
        def setUp(self):
            self.cache = {}

        def test_fill(self):
            self.cache["a"] = 1

        def test_empty(self):
            assert self.cache == {}
"""


def test_a_node_id_names_the_function_without_its_parameters() -> None:
    site = site_of("tests/test_a.py::TestX::Inner::test_y[1-a-b]")
    assert (site.path, site.classes, site.name) == ("tests/test_a.py", ("TestX", "Inner"), "test_y")
    module = """
        import pytest

        @pytest.mark.parametrize("n, m", [(1, 2)])
        def test_y(n, m):
            pass
    """
    hit = found(module, "t.py::test_y[1-2]")
    assert hit.function.name.value == "test_y" and hit.owner is None
    assert hit.parametrized == {"n", "m"} and hit.params == ("n", "m")
    assert find(parse(module), site_of("t.py::test_missing")) is None


def test_a_testcase_method_and_its_setup_are_found() -> None:
    hit = found(UNITTEST, "t.py::TestCache::test_empty")
    assert hit.is_method and hit.is_testcase and hit.params == ()
    assert [s.function.name.value for s in setups(hit)] == ["setUp"]
    plain = """
        def setup_function():
            open("/dev/null").close()

        def test_x():
            pass
    """
    assert [s.function.name.value for s in setups(found(plain, "t.py::test_x"))] == [
        "setup_function"
    ]


def test_module_tests_names_the_tests_the_source_shows() -> None:
    source = """
        import pytest

        def test_a():
            pass

        @pytest.mark.parametrize("n", [1, 2])
        def test_p(n):
            pass

        class TestK:
            def test_b(self):
                pass

        class Helper:
            def test_not_collected(self):
                pass
    """
    ids = module_tests(parse(source), "m.py", keep="m.py::test_p[2]")
    assert ids == ["m.py::test_a", "m.py::test_p[2]", "m.py::TestK::test_b"]


def test_statements_go_after_the_docstring_and_fixtures_before_defaults() -> None:
    hit = found(
        '''
        def test_x(a, b=1):
            """Doc."""
            assert a
        ''',
        "t.py::test_x",
    )
    function = prepend(hit.function, [cst.parse_statement("reset()")], "capsafe fix: here")
    function = add_params(function, ["monkeypatch", "a"])
    code = cst.Module([function]).code
    assert code.splitlines() == [
        "def test_x(a, monkeypatch, b=1):",
        '    """Doc."""',
        "    # capsafe fix: here",
        "    reset()",
        "    assert a",
    ]


def test_a_one_line_body_becomes_one_statement_a_line() -> None:
    hit = found("def test_x(): assert a; assert b\n", "t.py::test_x")
    function = prepend(hit.function, [cst.parse_statement("reset()")])
    assert cst.Module([function]).code.splitlines() == [
        "def test_x():",
        "    reset()",
        "    assert a",
        "    assert b",
    ]


def test_imports_go_after_the_future_import_and_are_not_repeated() -> None:
    module = parse('''
        """Doc."""
        from __future__ import annotations
        import os
    ''')
    out = add_imports(module, [Needed("os"), Needed("registry", "register"), Needed("copy")])
    lines = out.code.splitlines()
    assert lines.count("import os") == 1
    assert lines.index("from registry import register") > lines.index(
        "from __future__ import annotations"
    )
    assert "import copy" in lines


def test_names_used_leaves_out_attributes_keywords_and_lambda_arguments() -> None:
    stmt = cst.parse_statement("state.reset(mode=x, key=lambda k: k + y)")
    assert names_used(stmt) == {"state", "x", "y"}


def test_a_cleaner_carries_its_imports_and_fixtures_and_leaves_what_cannot_move() -> None:
    cleaner = """
        import pytest
        from state import reset
        from .helpers import tidy

        LOCAL = 1

        @pytest.mark.parametrize("n", [1])
        def test_clean(tmp_path, n):
            reset(tmp_path)
            tidy()
            print(LOCAL)
            print(n)
            pytest.skip("not here")
            return
            self.x = 1
    """
    victim = found("import state\n\ndef test_v():\n    pass\n", "other/test_v.py::test_v")
    offer = donation("t/test_c.py::test_clean", found(cleaner, "t/test_c.py::test_clean"), victim)
    assert [cst.Module([]).code_for_node(u.statement).strip() for u in offer.units] == [
        "reset(tmp_path)"
    ]
    assert offer.units[0].params == {"tmp_path"}
    assert offer.units[0].imports == (Needed("state", "reset"),)
    reasons = " | ".join(offer.skipped)
    for why in (
        "imported relatively",
        "uses LOCAL, defined in",
        "a parameter of the donor",
        "skip()",
        "return",
        "the victim is not a method",
    ):
        assert why in reasons, why
    code = implant(victim, offer.units, "capsafe fix: from a cleaner").code
    assert "def test_v(tmp_path):" in code and "from state import reset" in code


def test_self_moves_between_testcases_and_setup_comes_along() -> None:
    other = """
        import unittest

        class TestOther(unittest.TestCase):
            def setUp(self):
                self.cache = {"a": 1}

            def test_reset(self):
                self.cache.clear()
    """
    victim = found(UNITTEST, "t.py::TestCache::test_empty")
    offer = donation(
        "o.py::TestOther::test_reset", found(other, "o.py::TestOther::test_reset"), victim
    )
    moved = [cst.Module([]).code_for_node(u.statement).strip() for u in offer.units]
    assert moved == ['self.cache = {"a": 1}', "self.cache.clear()"]
    same = donation(
        "t.py::TestCache::test_fill", found(UNITTEST, "t.py::TestCache::test_fill"), victim
    )
    assert [cst.Module([]).code_for_node(u.statement).strip() for u in same.units] == [
        'self.cache["a"] = 1'
    ]  # the victim runs the same setUp: it is not moved twice


def test_ddmin_minimises_any_hashable_items() -> None:
    asked: list[tuple[int, ...]] = []

    def holds(items: object) -> bool:
        assert isinstance(items, list)
        asked.append(tuple(items))
        return {2, 5} <= set(items)

    assert ddmin(list(range(8)), holds) == [2, 5]


def polluter(tmp_path: Path, source: str, nodeid: str = "test_p.py::test_p") -> list[str]:
    """The rewritten polluter files `rewrites` proposes, each as text."""
    path = tmp_path / nodeid.split("::")[0]
    path.write_text(textwrap.dedent(source))
    hit = found(source, nodeid)
    out, _ = rewrites(nodeid, hit, tmp_path, {})
    return [r.source for r in out]


def test_environment_writes_become_monkeypatch_calls(tmp_path: Path) -> None:
    [source] = polluter(
        tmp_path,
        """
        import os

        def test_p():
            os.environ["A"] = "1"
            os.environ.update({"B": "2"})
            del os.environ["C"]
            os.environ.pop("D", None)
            assert os.environ["A"] == "1"
        """,
    )
    assert "def test_p(monkeypatch):" in source
    for line in (
        'monkeypatch.setenv("A", "1")',
        'monkeypatch.setenv("B", "2")',
        'monkeypatch.delenv("C")',
        'monkeypatch.delenv("D", raising=False)',
        'assert os.environ["A"] == "1"',
    ):
        assert f"    {line}\n" in source, line
    assert "os.environ[" not in source.replace('assert os.environ["A"]', "")


def test_module_state_becomes_setattr_setitem_or_a_restored_copy(tmp_path: Path) -> None:
    (tmp_path / "registry.py").write_text(
        "PLUGINS = []\nMODE = 'a'\n\ndef register(name):\n    PLUGINS.append(name)\n\n"
        "def switch():\n    global MODE\n    MODE = 'b'\n"
    )
    [source, deep] = polluter(
        tmp_path,
        """
        import registry
        import state

        def test_p():
            registry.TIMEOUT = 5
            state.CACHE["mode"] = "fast"
            registry.register("x")
            registry.switch()
            local = {}
            local["k"] = 1
        """,
    )
    assert 'monkeypatch.setattr(registry, "TIMEOUT", 5)' in source
    assert 'monkeypatch.setitem(state.CACHE, "mode", "fast")' in source
    assert 'monkeypatch.setattr(registry, "PLUGINS", copy.copy(registry.PLUGINS))' in source
    assert 'monkeypatch.setattr(registry, "MODE", registry.MODE)' in source
    assert 'local["k"] = 1' in source and "import copy" in source
    # Next candidate: nested state changed in place survives a shallow copy.
    assert 'monkeypatch.setattr(registry, "PLUGINS", copy.deepcopy(registry.PLUGINS))' in deep


def test_a_function_imported_in_the_test_that_rebinds_and_mutates_one_global(
    tmp_path: Path,
) -> None:
    """configaro's polluter: `from configaro import init, put` in its body; init() rebinds
    the global, put() changes it in place: one swap, for a copy, restores both."""
    (tmp_path / "config.py").write_text(
        "DATA = {}\n\ndef init():\n    global DATA\n    DATA = {'level': 'DEBUG'}\n\n"
        "def put(level):\n    DATA.update(level=level)\n"
    )
    source, _ = polluter(
        tmp_path,
        """
        def test_p():
            from config import init, put
            init()
            put("INFO")
        """,
    )
    assert source.count("monkeypatch.setattr(") == 1
    assert '    monkeypatch.setattr(config, "DATA", copy.copy(config.DATA))\n' in source
    assert "import config\n" in source


def test_a_testcase_polluter_restores_with_addcleanup_and_patch_dict(tmp_path: Path) -> None:
    sources = polluter(
        tmp_path,
        """
        import os
        import unittest
        import settings

        class TestP(unittest.TestCase):
            def test_p(self):
                settings.PRECISION = "fp16"
                os.environ["A"] = "1"
        """,
        "test_p.py::TestP::test_p",
    )
    first, env_only = sources
    assert "self.addCleanup(unittest.mock.patch.stopall)" in first
    assert 'unittest.mock.patch.object(settings, "PRECISION", "fp16", create=True).start()' in first
    assert 'settings.PRECISION = "fp16"' not in first and "monkeypatch" not in first
    assert "@unittest.mock.patch.dict(os.environ)" in env_only
    assert "import unittest.mock" in env_only


def test_nothing_to_rewrite_gives_no_candidate_but_a_fixed_path_is_noted(tmp_path: Path) -> None:
    source = """
        def test_p():
            with open("/tmp/report.csv", "w") as f:
                f.write("x")
    """
    (tmp_path / "test_p.py").write_text(textwrap.dedent(source))
    out, notes = rewrites("test_p.py::test_p", found(source, "test_p.py::test_p"), tmp_path, {})
    assert out == []
    assert any("/tmp/report.csv" in n and "tmp_path" in n for n in notes)


@pytest.mark.parametrize("kind", ["rebinding", "environ"])
def test_a_leak_the_source_does_not_show_falls_back_to_patch_dict(
    tmp_path: Path, kind: str
) -> None:
    source = "import helpers\n\ndef test_p():\n    helpers.configure()\n"
    (tmp_path / "test_p.py").write_text(source)
    leaks = {"A": (None, "1")} if kind == "environ" else {}
    out, _ = rewrites("test_p.py::test_p", found(source, "test_p.py::test_p"), tmp_path, leaks)
    if kind == "environ":
        assert len(out) == 1 and "@unittest.mock.patch.dict(os.environ)" in out[0].source
    else:
        assert out == []


def test_a_cleaners_teardown_moves_and_comments_above_a_statement_stay_behind() -> None:
    cleaner = """
        import decimal

        class TestRounding:
            def teardown_method(self):
                # back to the default
                decimal.getcontext().prec = 28

            def test_round(self):
                assert round(decimal.Decimal("2.5")) == 2
    """
    victim = found("import decimal\n\ndef test_v():\n    pass\n", "b/test_v.py::test_v")
    offer = donation(
        "a.py::TestRounding::test_round", found(cleaner, "a.py::TestRounding::test_round"), victim
    )
    moved = [
        cst.Module([]).code_for_node(u.statement).strip().splitlines()[-1] for u in offer.units
    ]
    assert moved == ['assert round(decimal.Decimal("2.5")) == 2', "decimal.getcontext().prec = 28"]
    code = implant(victim, offer.units[1:], "capsafe fix: from a cleaner").code
    assert "back to the default" not in code
    assert "    # capsafe fix: from a cleaner\n    decimal.getcontext().prec = 28\n" in code


def test_state_a_module_function_hands_out_is_set_with_setattr(tmp_path: Path) -> None:
    [source] = polluter(
        tmp_path,
        """
        import decimal

        def test_p():
            decimal.getcontext().prec = 4
            ctx = decimal.Context()
            ctx.prec = 2
            ctx.__class__.f = len
        """,
    )
    assert 'monkeypatch.setattr(decimal.getcontext(), "prec", 4)' in source
    assert "ctx.prec = 2" in source  # a local object: nobody else sees it
    assert 'monkeypatch.setattr(ctx.__class__, "f", len, raising=False)' in source


def test_what_a_test_creates_in_a_shared_fixture_directory_is_removed_after(tmp_path: Path) -> None:
    [source] = polluter(
        tmp_path,
        """
        import os

        def test_p(export_dir, tmp_path):
            (export_dir / "report.csv").write_text("x")
            (export_dir / "plots").mkdir()
            with open(os.path.join(export_dir, "log.txt"), "w") as f:
                f.write("x")
            (tmp_path / "own.txt").write_text("x")
            name = "local.txt"
            (export_dir / name).write_text("x")
        """,
    )
    assert "def test_p(export_dir, tmp_path, request):" in source
    for line in (
        "request.addfinalizer(lambda: pathlib.Path("
        'export_dir / "report.csv").unlink(missing_ok=True))',
        'request.addfinalizer(lambda: shutil.rmtree(export_dir / "plots", ignore_errors=True))',
        "request.addfinalizer(lambda: pathlib.Path("
        'os.path.join(export_dir, "log.txt")).unlink(missing_ok=True))',
    ):
        assert line in source, line
    assert 'own.txt").unlink' not in source  # tmp_path is the test's own
    assert "name).unlink" not in source  # built from a local: not mechanical


def test_a_brittle_test_that_deletes_what_it_never_set_tolerates_its_absence(
    tmp_path: Path,
) -> None:
    source = """
        import os
        import state

        def test_b():
            del os.environ["A"]
            del state.TABLE["k"]
            assert "A" not in os.environ
    """
    hit = found(source, "test_b.py::test_b")
    [rewrite] = rewrite_brittle("test_b.py::test_b", hit, tmp_path)
    assert '    monkeypatch.delenv("A", raising=False)\n' in rewrite.source
    assert '    monkeypatch.delitem(state.TABLE, "k", raising=False)\n' in rewrite.source
    reads = found("import state\n\ndef test_b():\n    assert state.TABLE['k']\n", "t.py::test_b")
    assert rewrite_brittle("t.py::test_b", reads, tmp_path) == []


def test_classes_a_test_defines_on_an_outside_base_are_collected_after_it(tmp_path: Path) -> None:
    sources = polluter(
        tmp_path,
        """
        from colltools import NameRegistry

        def test_p():
            class Registry(NameRegistry):
                __values__ = ["x"]

            class Error(Exception):
                pass
        """,
    )
    assert len(sources) == 1
    assert "def test_p(request):" in sources[0]
    assert "    request.addfinalizer(gc.collect)\n" in sources[0] and "import gc\n" in sources[0]
    builtin_only = "def test_p():\n    class Error(Exception):\n        pass\n"
    assert polluter(tmp_path, builtin_only) == []


def test_a_stop_after_asserts_goes_into_a_finally(tmp_path: Path) -> None:
    [source] = polluter(
        tmp_path,
        """
        import clock

        def test_p():
            freezer = clock.Freezer()
            freezer.start()
            assert clock.frozen()

            freezer.stop()
            assert not clock.frozen()
        """,
    )
    body = source.split("def test_p():\n", 1)[1]
    assert body.splitlines() == [
        "    freezer = clock.Freezer()",
        "    freezer.start()",
        "    try:",
        "        assert clock.frozen()",
        "    finally:",
        "        freezer.stop()",
        "    assert not clock.frozen()",
    ]


def test_a_reloaded_modules_globals_are_put_back(tmp_path: Path) -> None:
    [source] = polluter(
        tmp_path,
        """
        import importlib
        from freezegun import api

        try:
            reload
        except NameError:
            from importlib import reload

        def test_p():
            reload(api)
            importlib.reload(api)
        """,
    )
    line = "request.addfinalizer(functools.partial(api.__dict__.update, dict(api.__dict__)))"
    assert source.count(line) == 1 and "def test_p(request):" in source
    assert "import functools\n" in source


def test_under_mock_patch_a_fixture_goes_last_the_mock_fills_the_first_argument() -> None:
    hit = found(
        """
        from unittest import mock

        class TestX:
            @mock.patch("os.getcwd")
            def test_x(self, getcwd):
                pass
        """,
        "t.py::TestX::test_x",
    )
    function = add_params(hit.function, ["monkeypatch"])
    assert "def test_x(self, getcwd, monkeypatch):" in cst.Module([function]).code


def test_a_helper_of_the_cleaners_module_is_imported_from_it(tmp_path: Path) -> None:
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (tmp_path / "tests" / "unit" / "__init__.py").write_text("")
    assert importable(tmp_path, "tests/unit/test_c.py") == "tests.unit.test_c"
    assert importable(tmp_path, "plain/test_c.py") == "test_c"
    assert importable(tmp_path, "plain/test-c.py") is None
    cleaner = "def reset():\n    pass\n\n\ndef test_clean():\n    reset()\n"
    victim = found("def test_v():\n    pass\n", "tests/unit/test_v.py::test_v")
    donor = found(cleaner, "tests/unit/test_c.py::test_clean")
    offer = donation("tests/unit/test_c.py::test_clean", donor, victim, tmp_path)
    assert offer.skipped == [] and offer.units[0].imports == (Needed("tests.unit.test_c", "reset"),)
