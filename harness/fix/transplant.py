"""Patches that move another test's statements into the victim (iFixFlakies' approach).

A cleaner (a test that, run between the polluter and the victim, makes it pass) or a
state-setter (a test that, run before a brittle test, makes it pass) holds statements that
undo or set up the state the victim depends on. Its body (after its setup_method/setUp or
setup_function, when the victim does not run the same one, and before its teardown) is cut
into statements; delta
debugging keeps the fewest that, put at the start of the victim, still make it pass; the
imports they need come along. Statements that cannot be moved are left out and said why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from .edit import (
    Import,
    add_imports,
    add_params,
    body_of,
    dotted,
    module_bindings,
    names_used,
    prepend,
    replace,
)
from .locate import Found, setups, teardowns

ENDS_EARLY = ("skip", "skipTest", "xfail", "exit")
"""Calls that would end the victim before its own body runs (and so "pass" it)."""


@dataclass(frozen=True)
class Unit:
    """One statement that can move into the victim, with what it needs there."""

    statement: cst.BaseStatement
    params: frozenset[str] = frozenset()  # fixtures the victim must take
    imports: tuple[Import, ...] = ()


@dataclass
class Donation:
    """What a donor test offers a victim: the statements that can move, and why others cannot."""

    donor: str
    units: list[Unit] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def donation(donor_id: str, donor: Found, victim: Found, root: Path | None = None) -> Donation:
    """The donor's setup (unless the victim runs the same) then body, statement by statement."""
    out = Donation(donor_id)
    same_class = donor.site.path == victim.site.path and donor.site.classes == victim.site.classes
    same_module = donor.site.path == victim.site.path
    sources: list[Found] = []
    if not (same_class and donor.owner is not None) and not (same_module and donor.owner is None):
        sources += setups(donor)
    sources.append(donor)
    sources += teardowns(donor)  # a cleanup after the donor's body cleans before the victim's
    bindings = module_bindings(donor.module)
    victim_bindings = module_bindings(victim.module)
    for source in sources:
        _, statements = body_of(source.function)
        for statement in statements:
            why = _why_not(statement, source, donor, victim, same_class)
            if why:
                text = cst.Module([]).code_for_node(statement).strip().splitlines()[0]
                out.skipped.append(f"{source.site.name}: `{text}` {why}")
                continue
            names = names_used(statement)
            params = frozenset(n for n in names if n in source.params and n not in victim.params)
            imports: list[Import] = []
            unmovable = ""
            if not same_module:
                for name in sorted(names - set(source.params) - {"self"}):
                    if name not in bindings or name in victim_bindings:
                        continue  # a local, a builtin, or a name the victim's module has
                    bound = bindings[name]
                    if bound is None:  # a helper of the donor's module: import it from there
                        module = importable(root, donor.site.path) if root else None
                        if module is None:
                            unmovable = f"uses {name}, defined in {donor.site.path}"
                        else:
                            imports.append(Import(module, name))
                    elif bound.relative and _folder(donor.site.path) != _folder(victim.site.path):
                        unmovable = f"uses {name}, imported relatively in {donor.site.path}"
                    else:
                        imports.append(bound)
            if unmovable:
                text = cst.Module([]).code_for_node(statement).strip().splitlines()[0]
                out.skipped.append(f"{source.site.name}: `{text}` {unmovable}")
                continue
            out.units.append(Unit(statement, params, tuple(imports)))
    return out


def implant(victim: Found, units: Sequence[Unit], comment: str) -> cst.Module:
    """The victim's module with `units` at the start of the victim, their imports and fixtures."""
    function = prepend(victim.function, [u.statement for u in units], comment)
    function = add_params(function, sorted({p for u in units for p in u.params}))
    module = replace(victim.module, victim.function, function)
    return add_imports(module, [i for u in units for i in u.imports])


def _why_not(
    statement: cst.BaseStatement,
    source: Found,
    donor: Found,
    victim: Found,
    same_class: bool,
) -> str:
    """Why this statement cannot move into the victim ('' when it can)."""
    names = names_used(statement)
    finder = _EndsEarly()
    statement.visit(finder)
    if finder.found:
        return f"would end the victim early ({finder.found})"
    if "self" in names:
        if not victim.is_method:
            return "uses self, and the victim is not a method"
        if not (same_class or (victim.is_testcase and donor.is_testcase)):
            return "uses self of another class"
    for name in names & set(source.params):
        if source is not donor:
            return f"uses {name}, an argument of {source.site.name}"
        if name in source.parametrized:
            return f"uses {name}, a parameter of the donor"
        if victim.is_testcase and name not in victim.params:
            return f"uses the fixture {name}, and a TestCase method takes none"
    return ""


class _EndsEarly(cst.CSTVisitor):
    def __init__(self) -> None:
        self.found = ""

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False

    def visit_Return(self, node: cst.Return) -> None:
        self.found = self.found or "return"

    def visit_Yield(self, node: cst.Yield) -> None:
        self.found = self.found or "yield"

    def visit_Call(self, node: cst.Call) -> None:
        name = dotted(node.func).rsplit(".", 1)[-1]
        if name in ENDS_EARLY:
            self.found = self.found or f"{name}()"


def importable(root: Path, path: str) -> str | None:
    """The name a test process imports `path` (relative to `root`) under, as pytest's
    default import mode does: the folders above it that are packages, then its stem;
    None when that is not a Python name."""
    target = root / path
    parts = [target.stem]
    folder = target.parent
    while folder != root and (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts) if all(p.isidentifier() for p in parts) else None


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""
