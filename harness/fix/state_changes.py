"""What a polluter's code changes, read without running it: the analyses the idioms plan from.

Module-level state a statement mutates in place or rebinds, environment variables it
touches, files it creates under a fixed path, classes it defines, and the source of a module
of the suite a called function lives in. harness.fix.idioms turns what these find into
rewrites; nothing here rewrites.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import libcst as cst

from .edit import dotted, names_used

MUTATORS = frozenset(
    {"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "remove",
     "clear", "discard", "register", "__setitem__", "__delitem__", "appendleft"}
)  # fmt: skip
"""Methods that change a container in place: called on module state, a leak."""

WRITES = frozenset({"write_text", "write_bytes", "mkdir", "touch", "makedirs", "symlink_to"})
"""Calls that create a file or directory: under a fixed path, one the next test sees."""


def method_call(stmt: cst.BaseStatement) -> tuple[str, str]:
    """(`x`, `m`) for a statement that is only the call `x.m()`, else ('', '')."""
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            func = small.value.func
            if isinstance(func, cst.Attribute) and not small.value.args:
                return dotted(func.value), func.attr.value
    return "", ""


def is_class_of(expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.Attribute):
        return expr.attr.value == "__class__"
    return isinstance(expr, cst.Call) and dotted(expr.func) == "type" and len(expr.args) == 1


def subscript_key(target: cst.Subscript) -> str | None:
    index = target.slice[0].slice if len(target.slice) == 1 else None
    return code_of(index.value) if isinstance(index, cst.Index) else None


class StateChanges(cst.CSTVisitor):
    """Module-level names a function mutates in place or rebinds through `global`."""

    def __init__(self, top: set[str]) -> None:
        self.top = top
        self.declared: set[str] = set()
        self.changed: set[str] = set()
        self.rebound: set[str] = set()

    def visit_Global(self, node: cst.Global) -> None:
        self.declared |= {n.name.value for n in node.names}

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        if (
            isinstance(func, cst.Attribute)
            and func.attr.value in MUTATORS
            and isinstance(func.value, cst.Name)
            and func.value.value in self.top
        ):
            self.changed.add(func.value.value)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        target = node.target
        if isinstance(target, cst.Name) and target.value in self.declared:
            self.rebound.add(target.value)
        if (
            isinstance(target, cst.Subscript)
            and isinstance(target.value, cst.Name)
            and target.value.value in self.top
        ):
            self.changed.add(target.value.value)


def module_source(module_name: str, test_path: str, root: Path) -> str | None:
    """The source of `module_name` as the test's process would import it from the suite:
    beside the test file (pytest's rootdir-relative import) or from the rootdir."""
    rel = module_name.replace(".", "/")
    folder = (root / test_path).parent
    for base in (folder, *folder.parents):
        for candidate in (base / f"{rel}.py", base / rel / "__init__.py"):
            if candidate.is_file():
                return candidate.read_text(encoding="utf-8")
        if base == root:
            break
    return None


def assigned_names(body: Sequence[cst.BaseStatement]) -> set[str]:
    """Names the function body binds as plain names: its locals."""
    out: set[str] = set()

    class _Targets(cst.CSTVisitor):
        def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
            if isinstance(node.target, cst.Name):
                out.add(node.target.value)
            elif isinstance(node.target, cst.Tuple | cst.List):
                out.update(names_used(node.target))

        def visit_For(self, node: cst.For) -> None:
            out.update(names_used(node.target))

        def visit_AsName(self, node: cst.AsName) -> None:
            out.update(names_used(node.name))

    for stmt in body:
        stmt.visit(_Targets())
    return out


def global_names(body: Sequence[cst.BaseStatement]) -> set[str]:
    out: set[str] = set()
    for stmt in body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Global):
                    out |= {n.name.value for n in small.names}
    return out


def touches_env(stmt: cst.CSTNode, env_names: set[str]) -> bool:
    class _Env(cst.CSTVisitor):
        found = False

        def visit_Attribute(self, node: cst.Attribute) -> None:
            if dotted(node) in env_names or dotted(node) in ("os.putenv", "os.unsetenv"):
                self.found = True

        def visit_Name(self, node: cst.Name) -> None:
            if node.value in env_names:
                self.found = True

    finder = _Env()
    stmt.visit(finder)
    return finder.found


def note_files(stmt: cst.CSTNode, notes: list[str], test: str) -> None:
    """Note a file or directory created under a fixed (string literal) path."""

    class _Files(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            name = dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            literal = string_literal(node.args[0].value) if node.args else None
            if last == "open" and literal and len(node.args) > 1:
                mode = string_literal(node.args[1].value) or ""
                if any(c in mode for c in "wax"):
                    notes.append(
                        f"{test} writes {literal!r}, a fixed path: tmp_path would not leak"
                    )
            elif last in ("makedirs", "mkdir") and name.startswith("os.") and literal:
                notes.append(f"{test} creates {literal!r}, a fixed path: tmp_path would not leak")
            elif last in WRITES and isinstance(node.func, cst.Attribute):
                inner = node.func.value
                if isinstance(inner, cst.Call) and inner.args:
                    path = string_literal(inner.args[0].value)
                    if path and dotted(inner.func).rsplit(".", 1)[-1] == "Path":
                        notes.append(
                            f"{test} creates {path!r}, a fixed path: tmp_path would not leak"
                        )

    stmt.visit(_Files())


class LocalClasses(cst.CSTVisitor):
    """The bases (dotted) of the classes a test body defines."""

    def __init__(self) -> None:
        self.bases: list[str] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.bases += [dotted(b.value) for b in node.bases if dotted(b.value)]


class Creations(cst.CSTVisitor):
    """(path expression, "file" or "dir") of each file or directory a test body creates."""

    def __init__(self) -> None:
        self.created: list[tuple[cst.BaseExpression, str]] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        mode = string_literal(node.args[1].value) if len(node.args) > 1 else None
        if isinstance(func, cst.Attribute):
            method = func.attr.value
            first = string_literal(node.args[0].value) if node.args else None
            if method in ("write_text", "write_bytes", "touch"):
                self.created.append((func.value, "file"))
            elif method == "mkdir":
                self.created.append((func.value, "dir"))
            elif method == "open" and first and any(c in first for c in "wax"):
                self.created.append((func.value, "file"))
        elif dotted(func) == "open" and mode and any(c in mode for c in "wax"):
            self.created.append((node.args[0].value, "file"))


def calls_other_than_paths(expr: cst.BaseExpression) -> bool:
    """Does building the path call anything but Path(...) or os.path.join(...)?"""

    class _Calls(cst.CSTVisitor):
        found = False

        def visit_Call(self, node: cst.Call) -> None:
            if not dotted(node.func).endswith(("Path", "path.join")):
                self.found = True

    finder = _Calls()
    expr.visit(finder)
    return finder.found


def string_literal(expr: cst.BaseExpression) -> str | None:
    if isinstance(expr, cst.SimpleString):
        value = expr.evaluated_value
        return value if isinstance(value, str) else None
    return None


def code_of(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)
