"""Finding a test's code from its node id, and the setup code that runs before it.

A node id names a file, the classes around the test and the test (`path::Class::test_x[a-b]`);
the function is the name without its parameter id. What runs before its body and can matter
to a patch: its class's `setup_method` (pytest) or `setUp` (unittest) and the module's
`setup_function`. Fixtures from conftest files are not followed (docs/fixes.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from .edit import dotted

SETUPS = ("setup_method", "setUp")
"""Methods of a class that run before each of its tests (pytest's, then unittest's)."""
TEARDOWNS = ("teardown_method", "tearDown")
"""Methods of a class that run after each of its tests."""


@dataclass(frozen=True)
class Site:
    """Where a node id's code lives: a file (relative to the rootdir), classes, a function."""

    path: str
    classes: tuple[str, ...]
    name: str


def site_of(nodeid: str) -> Site:
    """`tests/test_a.py::TestX::test_y[1-2]` -> (tests/test_a.py, (TestX,), test_y)."""
    parts = nodeid.split("::")
    name = parts[-1].split("[", 1)[0] if len(parts) > 1 else ""
    return Site(parts[0], tuple(parts[1:-1]), name)


@dataclass(frozen=True)
class Found:
    """A test's function in a parsed module, with the class it is a method of (if any)."""

    site: Site
    module: cst.Module
    function: cst.FunctionDef
    owner: cst.ClassDef | None

    @property
    def is_method(self) -> bool:
        params = self.function.params.params
        return self.owner is not None and bool(params) and params[0].name.value == "self"

    @property
    def is_testcase(self) -> bool:
        """A unittest.TestCase method: it takes no fixtures and restores with addCleanup."""
        return self.owner is not None and is_testcase(self.owner)

    @property
    def params(self) -> tuple[str, ...]:
        """Its argument names without `self`: fixtures or parameters of a pytest test."""
        names = [p.name.value for p in self.function.params.params]
        return tuple(names[1:] if self.is_method else names)

    @property
    def parametrized(self) -> frozenset[str]:
        """Argument names its `@pytest.mark.parametrize` decorators give it."""
        return frozenset(_parametrized(self.function))


def read(root: Path, path: str) -> tuple[str, cst.Module]:
    """The source of `path` (relative to `root`) and its syntax tree."""
    with (root / path).open(encoding="utf-8", newline="") as f:  # its own line endings
        source = f.read()
    return source, cst.parse_module(source)


def find(module: cst.Module, site: Site) -> Found | None:
    """The function a node id names in `module`, or None (not found: generated, inherited)."""
    body: cst.Module | cst.ClassDef = module
    owner: cst.ClassDef | None = None
    for cls in site.classes:
        found = next((s for s in _statements(body) if _is_class(s, cls)), None)
        if not isinstance(found, cst.ClassDef):
            return None
        owner = body = found
    function = next(
        (
            s
            for s in _statements(body)
            if isinstance(s, cst.FunctionDef) and s.name.value == site.name
        ),
        None,
    )
    if not isinstance(function, cst.FunctionDef):
        return None
    return Found(site, module, function, owner)


def setups(found: Found) -> list[Found]:
    """What runs before the test's body: its class's setup method, else the module's
    `setup_function` (pytest runs one or the other for a test, not both)."""
    out: list[Found] = []
    if found.owner is not None:
        for name in SETUPS:
            setup = find(found.module, Site(found.site.path, found.site.classes, name))
            if setup is not None:
                out.append(setup)
                break
    else:
        setup = find(found.module, Site(found.site.path, (), "setup_function"))
        if setup is not None:
            out.append(setup)
    return out


def teardowns(found: Found) -> list[Found]:
    """What runs after the test's body: its class's teardown method, else the module's
    `teardown_function` (a cleaner's cleanup often lives there)."""
    out: list[Found] = []
    if found.owner is not None:
        for name in TEARDOWNS:
            teardown = find(found.module, Site(found.site.path, found.site.classes, name))
            if teardown is not None:
                out.append(teardown)
                break
    else:
        teardown = find(found.module, Site(found.site.path, (), "teardown_function"))
        if teardown is not None:
            out.append(teardown)
    return out


def is_testcase(cls: cst.ClassDef) -> bool:
    """Does it derive (by name) from a unittest TestCase (`TestCase`, `unittest.TestCase`,
    `IsolatedAsyncioTestCase`, a project's `...TestCase`)?"""
    return any(dotted(b.value).endswith("TestCase") for b in cls.bases)


def module_tests(module: cst.Module, path: str, *, keep: str = "") -> list[str]:
    """Node ids of the tests in `module` that its source names outright, in file order.

    Parametrized tests have ids only collection knows, so they are left out, except `keep`
    (the victim's own id). Ids that do not exist come back from a replay as "did not run".
    """
    out: list[str] = []

    def walk(body: cst.Module | cst.ClassDef, prefix: tuple[str, ...]) -> None:
        for stmt in _statements(body):
            if isinstance(stmt, cst.ClassDef) and (
                stmt.name.value.startswith("Test") or is_testcase(stmt)
            ):
                walk(stmt, (*prefix, stmt.name.value))
            elif isinstance(stmt, cst.FunctionDef) and stmt.name.value.startswith("test"):
                nodeid = "::".join((path, *prefix, stmt.name.value))
                if _parametrized(stmt):
                    if keep.split("[", 1)[0] == nodeid:
                        out.append(keep)
                else:
                    out.append(nodeid)

    walk(module, ())
    if keep and keep not in out:
        out.append(keep)
    return out


def _statements(body: cst.Module | cst.ClassDef) -> list[cst.CSTNode]:
    if isinstance(body, cst.Module):
        return list(body.body)
    inner = body.body
    return list(inner.body) if isinstance(inner, cst.IndentedBlock) else []


def _is_class(stmt: cst.CSTNode, name: str) -> bool:
    return isinstance(stmt, cst.ClassDef) and stmt.name.value == name


def _parametrized(function: cst.FunctionDef) -> set[str]:
    names: set[str] = set()
    for decorator in function.decorators:
        call = decorator.decorator
        if not isinstance(call, cst.Call) or not dotted(call.func).endswith("parametrize"):
            continue
        first = call.args[0].value if call.args else None
        if isinstance(first, cst.SimpleString):
            text = first.evaluated_value
            if isinstance(text, str):
                names.update(n.strip() for n in text.split(",") if n.strip())
        elif isinstance(first, cst.List | cst.Tuple):
            for element in first.elements:
                if isinstance(element.value, cst.SimpleString):
                    value = element.value.evaluated_value
                    if isinstance(value, str):
                        names.add(value)
    return names
