"""Edits of a test's syntax tree that every patch is made of, all with libcst (formatting and
comments outside the edit stay as they were): a function's statements, its arguments and
decorators, the imports a module needs, and the names a statement uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor


@dataclass(frozen=True)
class Import:
    """One name an edit needs imported: `import module` (obj None) or `from module import obj`."""

    module: str
    obj: str | None = None
    asname: str | None = None
    relative: int = 0


def body_of(function: cst.FunctionDef) -> tuple[list[cst.BaseStatement], list[cst.BaseStatement]]:
    """(its docstring statement, if any; every other statement), one small statement a line
    (`a; b` becomes two), so each can be moved or dropped on its own."""
    block = function.body
    if isinstance(block, cst.SimpleStatementSuite):
        lines: list[cst.BaseStatement] = [
            cst.SimpleStatementLine([s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)])
            for s in block.body
        ]
    else:
        lines = []
        for stmt in block.body:
            assert isinstance(stmt, cst.BaseStatement)
            if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) > 1:
                lines += [
                    cst.SimpleStatementLine([s.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)])
                    for s in stmt.body
                ]
            else:
                lines.append(stmt)
    doc = lines[:1] if lines and _is_docstring(lines[0]) else []
    return doc, lines[len(doc) :]


def with_body(
    function: cst.FunctionDef, statements: Sequence[cst.BaseStatement]
) -> cst.FunctionDef:
    """`function` with these statements as its body (an indented block)."""
    block = function.body
    indented = block if isinstance(block, cst.IndentedBlock) else cst.IndentedBlock(body=[])
    return function.with_changes(body=indented.with_changes(body=list(statements)))


def prepend(
    function: cst.FunctionDef, statements: Sequence[cst.BaseStatement], comment: str = ""
) -> cst.FunctionDef:
    """`statements` at the start of `function`'s body (after its docstring), the first one
    under `# comment` (the comments above them where they came from are left there)."""
    doc, rest = body_of(function)
    moved = [_bare(s) for s in statements]
    if moved and comment:
        moved[0] = _with_comment(moved[0], comment)
    return with_body(function, [*doc, *moved, *rest])


def add_params(function: cst.FunctionDef, names: Iterable[str]) -> cst.FunctionDef:
    """`function` also taking these arguments (fixtures), last but before any with a
    default: a `mock.patch` decorator's mocks fill the first ones (pytest passes fixtures by
    name, and leaves the first as many names as there are mocks to them)."""
    params = list(function.params.params)
    have = {p.name.value for p in params} | {p.name.value for p in function.params.kwonly_params}
    at = next((i for i, p in enumerate(params) if p.default is not None), len(params))
    new = [cst.Param(cst.Name(n)) for n in dict.fromkeys(names) if n not in have]
    if not new:
        return function
    params[at:at] = new
    params = [p.with_changes(comma=cst.MaybeSentinel.DEFAULT) for p in params]
    return function.with_changes(params=function.params.with_changes(params=params))


def add_decorator(function: cst.FunctionDef, expression: str) -> cst.FunctionDef:
    """`function` under `@expression` (the innermost decorator, so it wraps the test only)."""
    decorator = cst.Decorator(cst.parse_expression(expression))
    return function.with_changes(decorators=[*function.decorators, decorator])


def add_imports(module: cst.Module, imports: Iterable[Import]) -> cst.Module:
    """`module` with these imports added after its docstring and `__future__` imports
    (libcst's AddImportsVisitor: an import already there is not added twice)."""
    context = CodemodContext()
    wanted = list(dict.fromkeys(imports))
    if not wanted:
        return module
    for need in wanted:
        AddImportsVisitor.add_needed_import(
            context, need.module, need.obj, need.asname, need.relative
        )
    return AddImportsVisitor(context).transform_module(module)


def replace(module: cst.Module, old: cst.CSTNode, new: cst.CSTNode) -> cst.Module:
    """`module` with the node `old` (found by identity) replaced by `new`."""
    out = module.deep_replace(old, new)
    assert isinstance(out, cst.Module)
    return out


def names_used(node: cst.CSTNode) -> set[str]:
    """Every plain name in `node` that could refer to something outside it: not attribute
    names (`x.attr`), keyword-argument names, or names a nested def or lambda binds. An
    over-approximation (assigned names are in it too): callers only act on the names they
    know (imports, fixtures, `self`)."""
    collector = _Names()
    node.visit(collector)
    return collector.names


def dotted(expr: cst.BaseExpression) -> str:
    """`a.b.c` as text; '' for anything that is not a dotted name."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        head = dotted(expr.value)
        return f"{head}.{expr.attr.value}" if head else ""
    return ""


def module_bindings(module: cst.Module) -> dict[str, Import | None]:
    """Names a module binds at its top level (also inside top-level if/try blocks): the
    import that binds each, or None for a def, class or assignment of the module itself."""
    return bindings_of(module.body)


def bindings_of(statements: Sequence[cst.CSTNode]) -> dict[str, Import | None]:
    """Names these statements bind (not inside a def or class): the import that binds each,
    or None for anything else."""
    out: dict[str, Import | None] = {}
    collector = _Bindings(out)
    for stmt in statements:
        stmt.visit(collector)
    return out


class _Names(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)
        return False

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        for decorator in node.decorators:
            decorator.visit(self)
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        inner = names_used(node.body)
        self.names |= inner - {p.name.value for p in node.params.params}
        return False


class _Bindings(cst.CSTVisitor):
    """Top-level bindings; does not enter functions or classes (their names are local)."""

    def __init__(self, out: dict[str, Import | None]) -> None:
        self.out = out

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        self.out.setdefault(node.name.value, None)
        return False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.out.setdefault(node.name.value, None)
        return False

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            full = dotted(alias.name)
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                asname = alias.asname.name.value
                self.out.setdefault(asname, Import(full, asname=asname))
            else:
                self.out.setdefault(full.split(".")[0], Import(full))
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if isinstance(node.names, cst.ImportStar):
            return False
        module = dotted(node.module) if node.module is not None else ""
        relative = len(node.relative)
        for alias in node.names:
            obj = dotted(alias.name)
            asname = (
                alias.asname.name.value
                if alias.asname is not None and isinstance(alias.asname.name, cst.Name)
                else None
            )
            self.out.setdefault(asname or obj, Import(module, obj, asname, relative))
        return False

    def visit_AssignTarget(self, node: cst.AssignTarget) -> bool:
        for name in names_used(node.target):
            self.out.setdefault(name, None)
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> bool:
        if isinstance(node.target, cst.Name):
            self.out.setdefault(node.target.value, None)
        return False


def _is_docstring(stmt: cst.BaseStatement) -> bool:
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return False
    small = stmt.body[0]
    return isinstance(small, cst.Expr) and isinstance(
        small.value, cst.SimpleString | cst.ConcatenatedString
    )


def _bare(stmt: cst.BaseStatement) -> cst.BaseStatement:
    """Without the blank lines and comments above it: they described it where it was."""
    assert isinstance(stmt, cst.SimpleStatementLine | cst.BaseCompoundStatement)
    return stmt.with_changes(leading_lines=[])


def _with_comment(stmt: cst.BaseStatement, comment: str) -> cst.BaseStatement:
    assert isinstance(stmt, cst.SimpleStatementLine | cst.BaseCompoundStatement)
    line = cst.EmptyLine(comment=cst.Comment(f"# {comment}"))
    return stmt.with_changes(leading_lines=[line, *stmt.leading_lines])
