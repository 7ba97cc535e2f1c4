"""CI outputs of `capsafe sweep`: --junitxml in the shape of pytest's own JUnit XML, and
the GitHub Actions annotations and job summary under GITHUB_ACTIONS=true."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from capsafe_harness.report import github, junit

SUITE = {
    "test_mix.py": """
        import pytest

        @pytest.fixture(scope="session", autouse=True)
        def suite_property(record_testsuite_property):
            record_testsuite_property("planted", "yes")  # so pytest's XML has properties too

        def test_ok():
            pass

        def test_broken():
            assert 1 == 2, "the planted failure"

        def test_skipped():
            pytest.skip("needs a GPU")

        @pytest.mark.xfail(reason="known bug 12")
        def test_known():
            assert 0

        class TestGroup:
            @pytest.mark.parametrize("n", [1])
            def test_in_class(self, n):
                assert n == 2
    """,
    "test_import_error.py": "import no_such_module_capsafe\n",
}


def _vocabulary(root: ET.Element) -> dict[str, set[str]]:
    """Per element tag: its attributes and its child tags, as one set."""
    found: dict[str, set[str]] = {}
    for element in root.iter():
        found.setdefault(element.tag, set()).update(element.attrib, (c.tag for c in element))
    return found


@pytest.fixture(scope="module")
def swept(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = tmp_path_factory.mktemp("ci")
    suite = root / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\njunit_family = xunit2\n")
    for name, body in SUITE.items():
        (suite / name).write_text(textwrap.dedent(body))
    env = {**os.environ, "GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(root / "summary.md"),
           "GITHUB_WORKSPACE": str(root)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "capsafe.cli", "sweep", "--no-progress", "suite", "--runs", "1",
         "--workers", "0", "--isolation-runs", "1", "--seed", "5", "--out", str(root / "out"),
         "--junitxml", str(root / "ci" / "sweep.xml"), "--", "-p", "no:hypothesispytest"],
        cwd=root, capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    return root, done


def test_junitxml_has_one_testcase_per_test_with_the_verdict(
    swept: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    root, _ = swept
    tree = ET.parse(root / "ci" / "sweep.xml").getroot()
    (suite,) = tree.findall("testsuite")
    counts = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": "6", "failures": "3", "errors": "0", "skipped": "2"}
    cases = {(c.get("classname"), c.get("name")): c for c in suite.iter("testcase")}
    assert set(cases) == {
        ("test_mix", "test_ok"), ("test_mix", "test_broken"), ("test_mix", "test_skipped"),
        ("test_mix", "test_known"), ("test_mix.TestGroup", "test_in_class[1]"),
        ("", "test_import_error"),
    }  # fmt: skip
    failure = cases[("test_mix", "test_broken")].find("failure")
    assert failure is not None
    assert failure.get("message", "").startswith("fail: failed 1 of 1 suite runs")
    assert "the planted failure" in (failure.text or "")
    assert "Reproduce:" in (failure.text or "") and "--capsafe-replay" in (failure.text or "")
    # a collection error is a failure: junit-10.xsd has no `error` element (pytest's own
    # XML for one does not validate against it)
    error = cases[("", "test_import_error")].find("failure")
    assert error is not None
    assert error.get("message", "").startswith("error: ") and "no_such_module" in error.get(
        "message", ""
    )
    skipped = cases[("test_mix", "test_known")].find("skipped")
    assert skipped is not None and skipped.get("type") == "xfailed"
    assert "known bug 12" in skipped.get("message", "")
    assert list(cases[("test_mix", "test_ok")]) == []
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["seeds"] == "5" and props["runs"] == "1"


def test_junitxml_keeps_to_the_shape_of_pytests_own(
    swept: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """Every element, attribute and nesting the sweep writes is one pytest's own --junitxml
    writes for the same suite (its JUnit schema), and the schema's required attributes are
    there."""
    root, _ = swept
    theirs = root / "pytest.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "suite", f"--junitxml={theirs}", "-p", "no:randomly",
         "-p", "no:capsafe", "-p", "no:hypothesispytest", "-q",
         "--continue-on-collection-errors"],
        cwd=root, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    pytests = _vocabulary(ET.parse(theirs).getroot())
    ours = _vocabulary(ET.parse(root / "ci" / "sweep.xml").getroot())
    assert set(ours) <= set(pytests), set(ours) - set(pytests)
    for tag, used in ours.items():
        assert used <= pytests[tag], (tag, used - pytests[tag])
    tree = ET.parse(root / "ci" / "sweep.xml").getroot()
    for suite in tree.iter("testsuite"):
        assert {"name", "tests", "failures", "errors"} <= set(suite.attrib)
        assert float(suite.get("time", "")) >= 0
    assert all(case.get("name") for case in tree.iter("testcase"))


def test_github_actions_annotations_and_job_summary(
    swept: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    root, done = swept
    commands = [line for line in done.stdout.splitlines() if line.startswith("::")]
    assert len(commands) == 3, done.stdout
    broken = next(c for c in commands if "test_broken" in c)
    assert broken.startswith("::error file=suite/test_mix.py,line=11,title=capsafe sweep%3A fail::")
    assert "::test_mix.py::test_broken: failed 1 of 1 suite runs" in broken
    assert "%0AReproduce: " in broken and "--capsafe-replay=" in broken and "\n" not in broken
    assert any(c.startswith("::error file=suite/test_import_error.py,title=") for c in commands)
    summary = (root / "summary.md").read_text()
    assert summary.startswith("# capsafe sweep\n") and "tests need attention" in summary


def test_no_annotations_outside_actions(tmp_path: Path) -> None:
    out: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            out.append(text)

        def flush(self) -> None:
            pass

    test = {"nodeid": "t.py::test", "classification": "fail", "why": "w", "replay": ""}
    for env in ({}, {"GITHUB_ACTIONS": "false"}):
        github.write_actions_output([test], {}, tmp_path, "# r\n", env=env, stdout=Sink())  # type: ignore[arg-type]
    assert out == []
    github.write_actions_output([test], {"t.py::test": 3}, tmp_path, "# r\n",
                                env={"GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(tmp_path)},
                                stdout=Sink())  # type: ignore[arg-type]  # fmt: skip
    assert "".join(out) == "::error file=t.py,line=3,title=capsafe sweep%3A fail::t.py::test: w\n"


def test_names_are_pytests() -> None:
    assert junit.names("tests/sub/test_a.py::TestX::test_y[1-a]") == (
        "tests.sub.test_a.TestX", "test_y[1-a]",
    )  # fmt: skip
    assert junit.names("tests/test_a.py::test_b") == ("tests.test_a", "test_b")


def test_annotation_escapes_what_the_runner_reads() -> None:
    test = {"nodeid": "a,b.py::t", "classification": "flaky", "why": "50% of\nruns"}
    line = github.annotation(test, "a,b.py", 2, quarantined=True)
    assert (
        line == "::warning file=a%2Cb.py,line=2,title=capsafe sweep%3A flaky (quarantined)::"
        "a,b.py::t: 50%25 of%0Aruns"
    )
