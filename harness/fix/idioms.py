"""Idiomatic fixes of a polluter, read off its source: make it restore what it changes.

A polluter that writes shared state with a plain statement is rewritten to use the pytest
tool made for it, which undoes the change when the test ends, so every victim of that
polluter is fixed at once (docs/fixes.md has the table):

    os.environ[K] = v, os.environ.update({K: v}), os.putenv   -> monkeypatch.setenv
    del os.environ[K], os.environ.pop(K), os.unsetenv          -> monkeypatch.delenv
    module.attr = v, or a `global` the test rebinds             -> monkeypatch.setattr
    module.TABLE[k] = v, del module.TABLE[k]                    -> monkeypatch.setitem/delitem
    module.REGISTRY.append(x), module.register(x) that mutates
    a module-level container                                    -> monkeypatch.setattr of a copy
    any other change to os.environ (clear, setdefault, a helper) -> @mock.patch.dict(os.environ)
    a class defined in the test on an outside base (a subclass registry) -> gc.collect at its end
    x.start(), statements, x.stop()                             -> x.stop() in a finally
    importlib.reload(module)                                    -> its old globals put back after

A unittest.TestCase polluter takes no fixtures: it gets `unittest.mock.patch.object(...).start()`
with `self.addCleanup(unittest.mock.patch.stopall)`, `self.addCleanup(setattr, ...)` or
`@unittest.mock.patch.dict(...)` instead. A file written under a fixed path is only noted
(`tmp_path` suggested). Every rewrite is a candidate: only replay decides that it fixes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst

from .edit import (
    Import,
    add_decorator,
    add_imports,
    add_params,
    bindings_of,
    body_of,
    dotted,
    module_bindings,
    names_used,
    prepend,
    replace,
    with_body,
)
from .locate import Found
from .state_changes import (
    MUTATORS,
    Creations,
    LocalClasses,
    StateChanges,
    assigned_names,
    calls_other_than_paths,
    code_of,
    global_names,
    is_class_of,
    method_call,
    module_source,
    note_files,
    subscript_key,
    touches_env,
)

ENVIRON = "os.environ"
MONKEYPATCH = "monkeypatch"
STOPALL = "self.addCleanup(unittest.mock.patch.stopall)"
PER_TEST_DIRS = frozenset({"tmp_path", "tmpdir"})
"""Fixtures that give each test a directory of its own: what a test creates there cannot leak."""


@dataclass(frozen=True)
class Rewrite:
    """A candidate: the polluter's file rewritten, and what the rewrite does."""

    path: str
    source: str
    how: str


@dataclass
class _Plan:
    """What a polluter's statements call for, gathered before anything is rewritten."""

    doc: list[cst.BaseStatement] = field(default_factory=list)
    body: list[cst.BaseStatement] = field(default_factory=list)
    replaced: dict[int, list[cst.BaseSmallStatement]] = field(default_factory=dict)
    prelude: list[str] = field(default_factory=list)
    decorators: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    imports: list[Import] = field(default_factory=list)
    what: list[str] = field(default_factory=list)
    swaps: dict[tuple[str, str], bool] = field(default_factory=dict)  # (owner, attr) -> copied?
    guards: list[tuple[int, int]] = field(default_factory=list)  # ids of X.start(), X.stop()
    env_other: bool = False


def rewrites(
    cause: str,
    polluter: Found,
    root: Path,
    env_leaks: Mapping[str, tuple[str | None, str | None]],
) -> tuple[list[Rewrite], list[str]]:
    """Candidate rewrites of `polluter`, best first, and notes on what cannot be rewritten."""
    planner = _Planner(polluter, root)
    plan = planner.plan()
    out: list[Rewrite] = []
    if plan.what:
        what = "; ".join(dict.fromkeys(plan.what))
        out.append(_apply(polluter, plan, f"the polluter {cause} {what} (for every victim)"))
    if Import("copy") in plan.imports:  # a shallow copy shares nested state: a deep one next
        deep = _Planner(polluter, root, deep=True).plan()
        what = "; ".join(dict.fromkeys(deep.what))
        how = f"the polluter {cause} {what}, from a deep copy (for every victim)"
        out.append(_apply(polluter, deep, how))
    collect = _Planner(polluter, root).collect_plan()
    if collect is not None:
        how = (
            f"the polluter {cause} collects the classes it defines when it ends (for every victim)"
        )
        out.append(_apply(polluter, collect, how))
    if env_leaks or plan.env_other:
        doc, body = body_of(polluter.function)
        fallback = _Plan(
            doc=doc,
            body=body,
            decorators=["unittest.mock.patch.dict(os.environ)"],
            imports=[Import("os"), Import("unittest.mock")],
        )
        leaked = ", ".join(sorted(env_leaks)) or "the environment"
        how = (
            f"the polluter {cause} gets @unittest.mock.patch.dict(os.environ), which restores "
            f"{leaked} when it ends (for every victim)"
        )
        out.append(_apply(polluter, fallback, how))
    return [r for r in out if r.source != polluter.module.code], planner.notes


def rewrite_brittle(test: str, brittle: Found, root: Path) -> list[Rewrite]:
    """A brittle test that deletes what only another test set (`del os.environ[K]`) made
    to tolerate its absence (`monkeypatch.delenv(K, raising=False)`), its other writes
    restored as a polluter's are; nothing when its source shows none of that."""
    plan = _Planner(brittle, root, lenient=True).plan()
    if not any(line.startswith("deletes") for line in plan.what):
        return []
    what = "; ".join(dict.fromkeys(plan.what))
    rewrite = _apply(brittle, plan, f"the brittle test {test} {what} (for this test)")
    return [rewrite] if rewrite.source != brittle.module.code else []


def _apply(polluter: Found, plan: _Plan, how: str) -> Rewrite:
    function = polluter.function
    if plan.replaced or plan.guards:
        body = _guarded(_substitute(plan.body, plan.replaced), plan.guards)
        function = with_body(function, [*plan.doc, *body])
    if plan.prelude:
        function = prepend(
            function,
            [cst.parse_statement(line) for line in plan.prelude],
            "capsafe fix: restore the shared state this test changes",
        )
    for decorator in plan.decorators:
        function = add_decorator(function, decorator)
    function = add_params(function, plan.params)
    module = add_imports(replace(polluter.module, polluter.function, function), plan.imports)
    return Rewrite(polluter.site.path, module.code, how)


def _guarded(
    body: list[cst.BaseStatement], guards: Sequence[tuple[int, int]]
) -> list[cst.BaseStatement]:
    """`X.start()`, statements, `X.stop()` (found by identity) become `X.start()`, then
    `try:` the statements `finally: X.stop()`: a failing assert no longer leaves X started."""
    for start, stop in guards:
        at = next((i for i, s in enumerate(body) if id(s) == start), None)
        end = next((i for i, s in enumerate(body) if id(s) == stop), None)
        if at is None or end is None or end <= at + 1:
            continue
        inner = body[at + 1 : end]
        closing = body[end]
        assert isinstance(closing, cst.SimpleStatementLine)
        guard = cst.Try(
            body=cst.IndentedBlock(body=inner),
            finalbody=cst.Finally(
                body=cst.IndentedBlock(body=[closing.with_changes(leading_lines=[])])
            ),
        )
        body = [*body[: at + 1], guard, *body[end + 1 :]]
    return body


def _substitute(
    body: Sequence[cst.BaseStatement], replaced: Mapping[int, list[cst.BaseSmallStatement]]
) -> list[cst.BaseStatement]:
    """Top-level statements with the planned ones replaced (by identity of the small one)."""
    out: list[cst.BaseStatement] = []
    for stmt in body:
        if isinstance(stmt, cst.SimpleStatementLine) and id(stmt.body[0]) in replaced:
            new = replaced[id(stmt.body[0])]
            out += [
                (stmt if i == 0 else cst.SimpleStatementLine([])).with_changes(body=[small])
                for i, small in enumerate(new)
            ]
        else:
            out.append(stmt)
    return out


def _expr(code: str) -> cst.BaseSmallStatement:
    return cst.Expr(cst.parse_expression(code))


def _quote(module: cst.Module) -> str:
    """The quote most of the module's strings use (ruff's and black's double by default)."""

    class _Quotes(cst.CSTVisitor):
        single = double = 0

        def visit_SimpleString(self, node: cst.SimpleString) -> None:
            if node.quote == "'":
                self.single += 1
            elif node.quote == '"':
                self.double += 1

    counter = _Quotes()
    module.visit(counter)
    return "'" if counter.single > counter.double else '"'


class _Planner:
    """Reads one polluter's top-level statements and plans their rewrite."""

    def __init__(
        self, polluter: Found, root: Path, *, lenient: bool = False, deep: bool = False
    ) -> None:
        self.polluter = polluter
        self.root = root
        self.deep = deep  # a registry's stand-in is a deep copy (nested state changed in place)
        self.lenient = lenient  # a deletion tolerates an absent key (a brittle test's fix)
        self.unittest_style = polluter.is_testcase
        # What the module imports, and what the test imports in its own body (configaro's
        # `from configaro import init, put` inside the test).
        self.bindings = module_bindings(polluter.module)
        for name, bound in bindings_of(body_of(polluter.function)[1]).items():
            if bound is not None:
                self.bindings.setdefault(name, bound)
        self.notes: list[str] = []
        doc, body = body_of(polluter.function)
        self.p = _Plan(doc=doc, body=body)
        self.globals = global_names(body)
        self.quote = _quote(polluter.module)
        self.local = (set(polluter.params) | {"self"} | assigned_names(body)) - self.globals
        self.env_names = {ENVIRON} | {
            name
            for name, b in self.bindings.items()
            if b is not None and b.module == "os" and b.obj == "environ"
        }

    @property
    def _raising(self) -> str:
        return ", raising=False" if self.lenient else ""

    def _q(self, name: str) -> str:
        """An identifier as a string literal in the module's quotes."""
        return f"{self.quote}{name}{self.quote}"

    def plan(self) -> _Plan:
        for stmt in self.p.body:
            note_files(stmt, self.notes, self.polluter.site.name)
            if not isinstance(stmt, cst.SimpleStatementLine):
                self.p.env_other |= touches_env(stmt, self.env_names)
                continue
            new = self._statement(stmt.body[0])
            if new is not None:
                self.p.replaced[id(stmt.body[0])] = new
        self._guard_started()
        self.p.prelude[:0] = self._swap_lines()
        uses_monkeypatch = self.p.replaced or any(MONKEYPATCH in line for line in self.p.prelude)
        self._removes_what_it_creates()
        if not self.unittest_style and uses_monkeypatch and MONKEYPATCH not in self.polluter.params:
            self.p.params.append(MONKEYPATCH)
        return self.p

    def _guard_started(self) -> None:
        """`X.start()` ... `X.stop()` in the test's body (a freezer, a patcher): the stop
        goes into a `finally`, so the test that fails between them does not leave X on
        (freezegun's test_min_and_max, failing after another test's reload, left time frozen
        for every test after it)."""
        calls = [(i, method_call(s)) for i, s in enumerate(self.p.body)]
        for i, (target, method) in calls:
            if method != "start" or not target:
                continue
            stop = next((j for j, (t, m) in calls[i + 1 :] if t == target and m == "stop"), None)
            if stop is None or stop == i + 1:
                continue
            self.p.guards.append((id(self.p.body[i]), id(self.p.body[stop])))
            self.p.what.append(f"stops {target} in a finally")

    def collect_plan(self) -> _Plan | None:
        """A plan of its own (tried after the others: most local classes leak nothing): a
        class the test defines on a base from outside it stays in the base's
        `__subclasses__()` (what subclass registries walk) until the cyclic garbage collector
        frees it, so collect when the test ends (colltools' NameRegistry)."""
        self._collects_its_classes()
        return self.p if self.p.what else None

    def _collects_its_classes(self) -> None:
        found = LocalClasses()
        for stmt in self.p.body:
            stmt.visit(found)
        outside = set(self.bindings) | self.globals
        if not any(base.split(".", 1)[0] in outside for base in found.bases):
            return
        self.p.imports.append(Import("gc"))
        add = "self.addCleanup" if self.unittest_style else "request.addfinalizer"
        self.p.prelude.append(f"{add}(gc.collect)")
        self.p.what.append("collects the classes it defines when it ends")
        if not self.unittest_style and "request" not in self.polluter.params:
            self.p.params.append("request")

    def _removes_what_it_creates(self) -> None:
        """A file or directory the test creates at a path built from a fixture (a shared
        directory of the session, not its own tmp_path): removed when the test ends."""
        owned = set(self.polluter.params) - PER_TEST_DIRS
        if self.unittest_style:
            owned = {"self"}
        allowed = owned | set(self.bindings) | {"self"}
        found = Creations()
        for stmt in self.p.body:
            stmt.visit(found)
        for path, kind in found.created:
            names = names_used(path)
            if not names & owned or not names <= allowed or calls_other_than_paths(path):
                continue
            text = code_of(path.with_changes(lpar=[], rpar=[]) if path.lpar else path)
            if kind == "dir":
                self.p.imports.append(Import("shutil"))
                undo = f"lambda: shutil.rmtree({text}, ignore_errors=True)"
            else:
                self.p.imports.append(Import("pathlib"))
                undo = f"lambda: pathlib.Path({text}).unlink(missing_ok=True)"
            add = "self.addCleanup" if self.unittest_style else "request.addfinalizer"
            line = f"{add}({undo})"
            if line in self.p.prelude:
                continue
            self.p.prelude.append(line)
            self.p.what.append(f"removes {text} it creates when it ends")
            if not self.unittest_style and "request" not in self.polluter.params:
                self.p.params.append("request")

    def shared(self, expr: cst.BaseExpression) -> str:
        """The text of `expr` when it names module state (not a local), else '': a dotted
        name, or a call of one (`decimal.getcontext()`: the object a module function hands
        out, as process-wide as the module)."""
        if is_class_of(expr):  # o.__class__, type(o): a class, shared even when o is not
            return code_of(expr)
        if isinstance(expr, cst.Call):
            return code_of(expr) if self.shared(expr.func) else ""
        text = dotted(expr)
        head = text.split(".", 1)[0]
        if not text or head in self.local:
            return ""
        return text if head in self.bindings or head in self.globals else ""

    def env(self, expr: cst.BaseExpression) -> bool:
        return dotted(expr) in self.env_names

    def _statement(self, small: cst.BaseSmallStatement) -> list[cst.BaseSmallStatement] | None:
        """The statements that replace `small` (pytest style), or None to leave it (unittest
        style keeps it and plans a restoring statement or decorator instead)."""
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            return self._assign(small.targets[0].target, code_of(small.value))
        if isinstance(small, cst.Del) and isinstance(small.target, cst.Subscript):
            return self._delete(small.target)
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            return self._call(small.value)
        return None

    def _assign(
        self, target: cst.BaseAssignTargetExpression, value: str
    ) -> list[cst.BaseSmallStatement] | None:
        p, mp = self.p, MONKEYPATCH
        if isinstance(target, cst.Subscript):
            key = subscript_key(target)
            if key is None:
                return None
            if self.env(target.value):
                if self.unittest_style:
                    p.env_other = True
                    return None
                p.what.append(f"sets {key} with monkeypatch.setenv")
                return [_expr(f"{mp}.setenv({key}, {value})")]
            holder = self.shared(target.value)
            if not holder:
                return None
            if self.unittest_style:
                p.decorators.append(f"unittest.mock.patch.dict({holder})")
                p.imports.append(Import("unittest.mock"))
                p.what.append(f"restores {holder} with unittest.mock.patch.dict")
                return None
            p.what.append(f"sets {holder}[{key}] with monkeypatch.setitem")
            return [_expr(f"{mp}.setitem({holder}, {key}, {value})")]
        if isinstance(target, cst.Attribute):
            holder, attr = self.shared(target.value), target.attr.value
            if not holder or self.env(target):
                return None
            if self.unittest_style:  # unittest.mock's own pattern: start(), addCleanup(stopall)
                p.what.append(f"sets {holder}.{attr} with unittest.mock.patch.object")
                p.imports.append(Import("unittest.mock"))
                if STOPALL not in p.prelude:
                    p.prelude.append(STOPALL)
                patch = (
                    f"unittest.mock.patch.object({holder}, {self._q(attr)}, {value}, create=True)"
                )
                return [_expr(f"{patch}.start()")]
            p.what.append(f"sets {holder}.{attr} with monkeypatch.setattr")
            # A class's attribute a test adds (o.__class__.f = ...) did not exist before it.
            raising = ", raising=False" if is_class_of(target.value) else ""
            return [_expr(f"{mp}.setattr({holder}, {self._q(attr)}, {value}{raising})")]
        if isinstance(target, cst.Name) and target.value in self.globals:
            name = target.value
            p.imports.append(Import("sys"))
            p.what.append(f"rebinds the global {name} with monkeypatch.setattr")
            here = "sys.modules[__name__]"
            if self.unittest_style:
                p.prelude.append(f"self.addCleanup(setattr, {here}, {self._q(name)}, {name})")
                return None
            return [_expr(f"{mp}.setattr({here}, {self._q(name)}, {value})")]
        return None

    def _delete(self, target: cst.Subscript) -> list[cst.BaseSmallStatement] | None:
        key = subscript_key(target)
        if key is None:
            return None
        if self.env(target.value):
            if self.unittest_style:
                self.p.env_other = True
                return None
            self.p.what.append(f"deletes {key} with monkeypatch.delenv")
            return [_expr(f"{MONKEYPATCH}.delenv({key}{self._raising})")]
        holder = self.shared(target.value)
        if holder and not self.unittest_style:
            self.p.what.append(f"deletes {holder}[{key}] with monkeypatch.delitem")
            return [_expr(f"{MONKEYPATCH}.delitem({holder}, {key}{self._raising})")]
        return None

    def _call(self, call: cst.Call) -> list[cst.BaseSmallStatement] | None:
        p, mp = self.p, MONKEYPATCH
        name = dotted(call.func)
        args = [code_of(a.value) for a in call.args]
        plain = all(a.keyword is None and not a.star for a in call.args)
        if isinstance(call.func, cst.Attribute) and self.env(call.func.value):
            method = call.func.attr.value
            if self.unittest_style:
                p.env_other = True
                return None
            pairs = call.args[0].value if len(call.args) == 1 and plain else None
            if method == "update" and isinstance(pairs, cst.Dict):
                elements = [e for e in pairs.elements if isinstance(e, cst.DictElement)]
                if len(elements) == len(pairs.elements):
                    p.what.append("sets the variables with monkeypatch.setenv")
                    return [
                        _expr(f"{mp}.setenv({code_of(e.key)}, {code_of(e.value)})")
                        for e in elements
                    ]
            keywords = [a for a in call.args if a.keyword is not None]
            if method == "update" and keywords and len(keywords) == len(call.args):
                p.what.append("sets the variables with monkeypatch.setenv")
                return [
                    _expr(f"{mp}.setenv({self._q(a.keyword.value)}, {code_of(a.value)})")
                    for a in keywords
                    if a.keyword is not None
                ]
            if method == "pop" and len(args) in (1, 2) and plain:
                p.what.append(f"deletes {args[0]} with monkeypatch.delenv")
                return [_expr(f"{mp}.delenv({args[0]}, raising=False)")]
            p.env_other = True
            return None
        if name in ("os.putenv", "os.unsetenv") and plain:
            if self.unittest_style:
                p.env_other = True
                return None
            if name == "os.putenv" and len(args) == 2:
                p.what.append(f"sets {args[0]} with monkeypatch.setenv")
                return [_expr(f"{mp}.setenv({args[0]}, {args[1]})")]
            if name == "os.unsetenv" and len(args) == 1:
                p.what.append(f"deletes {args[0]} with monkeypatch.delenv")
                return [_expr(f"{mp}.delenv({args[0]}, raising=False)")]
            return None
        if self._reloads(name) and len(call.args) == 1 and plain:
            module = self.shared(call.args[0].value)
            if module:
                self._restore_globals(module)
            return None
        # A registry: module state changed in place, by the test itself or a function it calls.
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in MUTATORS:
            holder = self.shared(call.func.value)
            if "." in holder:
                owner, attr = holder.rsplit(".", 1)
                self._copy_before(owner, attr, rebinds=False)
                return None
        for owner, attr, rebinds in _mutated_by(name, self.polluter, self.root, self.bindings, p):
            self._copy_before(owner, attr, rebinds=rebinds)
        return None

    def _reloads(self, name: str) -> bool:
        """Is `name` importlib.reload (or imp's), however the module imported it?"""
        if name in ("importlib.reload", "imp.reload"):
            return True
        bound = self.bindings.get(name)
        return name == "reload" and (bound is None or bound.module in ("importlib", "imp"))

    def _restore_globals(self, module: str) -> None:
        """A reloaded module's globals are new objects (new classes, new functions) that the
        modules which imported the old ones do not see: the old ones are put back when the
        test ends (freezegun's reload(api))."""
        add = "self.addCleanup" if self.unittest_style else "request.addfinalizer"
        line = f"{add}(functools.partial({module}.__dict__.update, dict({module}.__dict__)))"
        if line in self.p.prelude:
            return
        self.p.prelude.append(line)
        self.p.imports.append(Import("functools"))
        self.p.what.append(f"puts back the globals of {module} it reloads when it ends")
        if not self.unittest_style and "request" not in self.polluter.params:
            self.p.params.append("request")

    def _copy_before(self, owner: str, attr: str, *, rebinds: bool) -> None:
        """Plan to swap `owner.attr`, before the test's body, for a copy (or itself, when it
        is only rebound) that is put back when the test ends; a copy wins over itself."""
        key = (owner, attr)
        self.p.swaps[key] = self.p.swaps.get(key, False) or not rebinds
        self.p.what.append(f"restores {owner}.{attr} when it ends")

    def _swap_lines(self) -> list[str]:
        lines: list[str] = []
        copier = "copy.deepcopy" if self.deep else "copy.copy"
        for (owner, attr), copied in self.p.swaps.items():
            value = f"{copier}({owner}.{attr})" if copied else f"{owner}.{attr}"
            if copied:
                self.p.imports.append(Import("copy"))
            if self.unittest_style:
                lines.append(f"self.addCleanup(setattr, {owner}, {self._q(attr)}, {owner}.{attr})")
                if copied:
                    lines.append(f"{owner}.{attr} = {value}")
            else:
                lines.append(f"{MONKEYPATCH}.setattr({owner}, {self._q(attr)}, {value})")
        return lines


def _mutated_by(
    name: str,
    polluter: Found,
    root: Path,
    bindings: Mapping[str, Import | None],
    plan: _Plan,
) -> list[tuple[str, str, bool]]:
    """(module name as the polluter's file can write it, state, rebound?) for each module-level
    name the called function `name` changes (one level: its own body), when the function is a
    module of the suite's own."""
    head, _, rest = name.partition(".")
    bound = bindings.get(head)
    if not isinstance(bound, Import):
        return []
    if bound.obj is None and rest and "." not in rest:  # import registry; registry.register()
        module_name, function, owner = bound.module, rest, bound.asname or bound.module
    elif bound.obj is not None and not rest:  # from registry import register; register()
        module_name, function, owner = bound.module, bound.obj, bound.module.split(".")[-1]
        if bound.relative:
            return []
        plan.imports.append(Import(bound.module, asname=None))
        owner = bound.module
    else:
        return []
    source = module_source(module_name, polluter.site.path, root)
    if source is None:
        return []
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        return []
    top = module_bindings(module)
    target = next(
        (s for s in module.body if isinstance(s, cst.FunctionDef) and s.name.value == function),
        None,
    )
    if target is None:
        return []
    found = StateChanges(set(top))
    target.body.visit(found)
    return [(owner, n, n in found.rebound) for n in sorted(found.changed | found.rebound)]
