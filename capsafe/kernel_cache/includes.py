"""What NVRTC will read for a translation unit, resolved once, as NVRTC resolves it.

NVRTC 13's rules, measured (tests/kernel_cache/test_kernel_cache_includes.py checks each against
the real library): an in-memory header whose name is the include's exact spelling wins,
for quoted and angle includes, from any file; otherwise a quoted include is looked up
in the including file's own directory (the program name's directory for the main
source, the working directory when it has none; an in-memory header's name's
directory), then in the -I paths in order; an angle include only in the -I paths;
`#include_next` continues after the -I path the current file was found in (or acts
as #include). Directives are found the way the preprocessor finds them: line
continuations spliced, comments skipped (also before `#`), `%:` as `#`.

`resolve` reads each file once and returns a Translation: the main source and every
header with each followed directive rewritten to name the exact file it resolved to,
all of it to be handed to NVRTC as in-memory headers (no -I paths), so the bytes the
key hashes are the bytes NVRTC compiles. A form it cannot follow (`#include MACRO`,
`__has_include`, a non-UTF-8 file...) makes the translation uncacheable, with a reason.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import re
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from capsafe.kernel_cache.dirs import O_CLOEXEC, O_NONBLOCK, read_all

MAX_DEPTH = 200
_SCAN = re.compile(rb"\n|/\*|//|\"|'|#|%:|\?\?=")
# A block comment without its `*/` runs to the end of the text (as the preprocessor reads
# it): matching it there, not failing, keeps lexing linear when each of many directive
# lines opens one (failing, every line rescanned the rest of the file: quadratic).
_COMMENT = rb"/\*.*?(?:\*/|\Z)"
_SPACE = rb"(?:[ \t\f\v\r]|" + _COMMENT + rb")*"
_NAME = re.compile(_SPACE + rb"([A-Za-z_][A-Za-z0-9_]*)?", re.S)
_HEADER_NAME = re.compile(_SPACE + rb'(?:"([^"\n]*)"|<([^>\n]*)>)', re.S)
_REST = re.compile(
    rb'(?:"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|'
    + _COMMENT
    + rb'|//[^\n]*|[^\n/"\']+|/|["\'])*',
    re.S,
)
_STRING = re.compile(rb'"(?:\\.|[^"\\\n])*"?')
_CHAR = re.compile(rb"'(?:\\.|[^'\\\n])*'?")
_RAW_PREFIXES = (b"R", b"u8R", b"uR", b"UR", b"LR")
_IDENT = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_SPLICE = re.compile(rb"\\\r?\n")


class Unfollowable(Exception):
    """The sources use a form this resolver cannot follow; the message says where."""


@dataclass(frozen=True)
class Directive:
    start: int  # offsets in the original bytes: the directive's whole logical line
    end: int
    newlines: int  # physical line breaks inside it (continuations, comments)
    spelling: str
    quoted: bool
    next: bool  # include_next


@dataclass
class Translation:
    """What to hand NVRTC, and what the key hashes: exactly the same bytes."""

    source: bytes
    headers: dict[str, bytes] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # paths that must stay absent

    def nvrtc_source(self) -> str:
        return self.source.decode()  # every file was checked to be UTF-8 when it was lexed

    def nvrtc_headers(self) -> dict[str, str]:
        return {name: body.decode() for name, body in self.headers.items()}

    def still_valid(self) -> bool:
        """True while every path that was missing still is (NVRTC may look there)."""
        for path in self.missing:
            try:
                os.lstat(path)
            except OSError:
                continue
            return False
        return True

    def key_fields(self) -> list[bytes | str]:
        fields: list[bytes | str] = ["source", self.source, f"headers:{len(self.headers)}"]
        for name in sorted(self.headers):
            fields += [name, self.headers[name]]
        fields.append(f"missing:{len(self.missing)}")
        fields += self.missing
        return fields


_memo: dict[bytes, tuple[Directive, ...] | str] = {}
_memo_lock = threading.Lock()
_MEMO_LIMIT = 4096


def reset_after_fork() -> None:
    global _memo_lock
    _memo_lock = threading.Lock()


def directives(text: bytes) -> tuple[Directive, ...]:
    """Every #include / #include_next in `text`; Unfollowable for forms not followed.

    Memoized by content digest: a hit re-reads the headers but lexes none of them.
    """
    digest = hashlib.sha256(text).digest()
    with _memo_lock:
        found = _memo.get(digest)
    if found is None:
        try:
            found = _lex(text)
        except Unfollowable as exc:
            found = str(exc)
        with _memo_lock:
            if len(_memo) >= _MEMO_LIMIT:
                _memo.clear()
            _memo[digest] = found
    if isinstance(found, str):
        raise Unfollowable(found)
    return found


def _lex(raw: bytes) -> tuple[Directive, ...]:
    try:
        raw.decode()
    except UnicodeDecodeError as exc:
        raise Unfollowable(f"not UTF-8 text (byte {exc.start})") from exc
    if b"__has_include" in raw:
        raise Unfollowable(f"line {_line(raw, raw.index(b'__has_include'))}: __has_include")
    cuts: list[int] = []  # positions in the spliced text where a splice was removed
    cut_lengths: list[int] = []
    if b"\\\n" in raw or b"\\\r\n" in raw:
        pieces, removed, last = [], 0, 0
        for splice in _SPLICE.finditer(raw):
            pieces.append(raw[last : splice.start()])
            removed += splice.end() - splice.start()
            cuts.append(splice.end() - removed)
            cut_lengths.append(removed)
            last = splice.end()
        pieces.append(raw[last:])
        text = b"".join(pieces)
    else:
        text = raw

    def orig(p: int) -> int:
        i = bisect.bisect_right(cuts, p)
        return p + (cut_lengths[i - 1] if i else 0)

    found: list[Directive] = []
    pos, line_start, n = 0, True, len(text)
    while (m := _SCAN.search(text, pos)) is not None:
        i, tok = m.start(), m.group()
        if line_start and text[pos:i].strip(b" \t\f\v\r"):
            line_start = False
        if tok == b"\n":
            line_start, pos = True, m.end()
        elif tok == b"/*":
            end = text.find(b"*/", m.end())
            pos = n if end < 0 else end + 2
        elif tok == b"//":
            end = text.find(b"\n", m.end())
            pos = n if end < 0 else end
        elif tok == b'"':
            pos, line_start = _skip_string(text, i), False
        elif tok == b"'":
            j = i
            while j > 0 and text[j - 1] in _IDENT:
                j -= 1
            digit_separator = j < i and text[j : j + 1].isdigit()
            pos = i + 1 if digit_separator else _end(_CHAR, text, i)
            line_start = False
        elif not line_start:
            pos = m.end()
        elif tok == b"??=":
            raise Unfollowable(f"line {_line(raw, orig(i))}: a trigraph directive")
        else:
            pos = _directive(text, raw, i, m.end(), orig, found)
    return tuple(found)


def _skip_string(text: bytes, i: int) -> int:
    j = i
    while j > 0 and text[j - 1] in _IDENT:
        j -= 1
    if text[j:i] in _RAW_PREFIXES:
        open_paren = text.find(b"(", i + 1, i + 18)
        if open_paren > 0:
            close = text.find(b")" + text[i + 1 : open_paren] + b'"', open_paren)
            return len(text) if close < 0 else close + open_paren - i + 1
    return _end(_STRING, text, i)


def _directive(
    text: bytes,
    raw: bytes,
    start: int,
    after_hash: int,
    orig: Callable[[int], int],
    found: list[Directive],
) -> int:
    """Record an #include at `start` (the `#`) in `found`; where its logical line ends."""
    name_match = _NAME.match(text, after_hash)
    assert name_match is not None  # the pattern matches the empty string
    name = name_match.group(1) or b""
    if name in (b"include", b"include_next", b"import"):
        header = _HEADER_NAME.match(text, name_match.end())
        where = f"line {_line(raw, orig(start))}"
        if header is None:
            raise Unfollowable(f"{where}: #{name.decode()} with a macro, not a header name")
        if name == b"import":
            raise Unfollowable(f"{where}: #import")
        end = _end(_REST, text, header.end())
        o_start, o_end = orig(start), orig(end - 1) + 1 if end > start else orig(start)
        spelling = header.group(1) if header.group(1) is not None else header.group(2)
        try:
            decoded = spelling.decode()
        except UnicodeDecodeError as exc:
            raise Unfollowable(f"{where}: a header name that is not UTF-8") from exc
        found.append(
            Directive(
                o_start,
                o_end,
                raw.count(b"\n", o_start, o_end),
                decoded,
                header.group(1) is not None,
                name == b"include_next",
            )
        )
        return end
    if name == b"embed":
        raise Unfollowable(f"line {_line(raw, orig(start))}: #embed")
    return _end(_REST, text, name_match.end())


def _end(pattern: re.Pattern[bytes], text: bytes, pos: int) -> int:
    """Where `pattern` ends when matched at `pos` (past one character when it does not)."""
    found = pattern.match(text, pos)
    return pos + 1 if found is None else found.end()


def _line(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


@dataclass(frozen=True)
class _File:
    """Where a file was found: what the preprocessor would call it, and its -I index."""

    name: str  # the in-memory name it is handed to NVRTC under
    directory: str  # the directory its quoted includes are looked up in first
    index: int | None  # which -I path it was found in (for include_next)


def resolve(
    source: str, name: str, headers: Mapping[str, str], include_paths: Sequence[str]
) -> Translation:
    """The Translation of `source`; Unfollowable when a form cannot be followed."""
    out = Translation(b"")
    by_identity: dict[tuple[int, int, str], str] = {}
    try:
        cwd = os.getcwd()
    except OSError as exc:  # the working directory was removed
        raise Unfollowable(f"no working directory to resolve includes in: {exc}") from exc
    paths = [_directory(os.path.join(cwd, p)) for p in include_paths]
    missing: set[str] = set()

    def rewrite(text: bytes, here: _File, depth: int) -> bytes:
        if depth > MAX_DEPTH:
            raise Unfollowable(f"includes nest deeper than {MAX_DEPTH}")
        pieces, last = [], 0
        try:
            found = directives(text)
        except Unfollowable as exc:
            raise Unfollowable(f"{here.name}: {exc}") from exc
        for d in found:
            target = find(d, here, depth)
            if target is None:
                continue
            pieces += [text[last : d.start], f'#include "{target}"'.encode(), b"\n" * d.newlines]
            last = d.end
        pieces.append(text[last:])
        return b"".join(pieces)

    def find(d: Directive, here: _File, depth: int) -> str | None:
        """The in-memory name `d` resolves to (None: leave it, it names one already)."""
        if d.spelling in headers:
            if d.next:
                raise Unfollowable(f"#include_next of in-memory header {d.spelling!r}")
            if d.spelling not in out.headers:
                out.headers[d.spelling] = b""  # placeholder: breaks include cycles
                mem_dir = _directory(os.path.join(cwd, os.path.dirname(d.spelling)))
                body = rewrite(
                    headers[d.spelling].encode(), _File(d.spelling, mem_dir, None), depth + 1
                )
                out.headers[d.spelling] = body
            return None
        tried = []
        for candidate, index in _candidates(d, here, paths):
            try:
                data, identity = _read_header(candidate)
            except (FileNotFoundError, NotADirectoryError):
                tried.append(candidate)
                continue
            except OSError as exc:
                raise Unfollowable(f"cannot read {candidate}: {exc.strerror or exc}") from exc
            known = by_identity.get(identity)
            if known is not None:
                return known
            if candidate in headers:
                raise Unfollowable(f"{candidate} is both an in-memory header and a file")
            if '"' in candidate or "\n" in candidate:
                raise Unfollowable(f"{candidate!r} cannot be named in an #include")
            by_identity[identity] = candidate
            out.headers[candidate] = b""
            out.headers[candidate] = rewrite(
                data, _File(candidate, _directory(os.path.dirname(candidate)), index), depth + 1
            )
            return candidate
        # Not found: NVRTC reports it, or an #if around it skips it. NVRTC may look for
        # it on disk, so it must still be missing when the compile is done.
        missing.update(tried)
        return None

    main_dir = _directory(os.path.join(cwd, os.path.dirname(name)))
    out.source = rewrite(source.encode(), _File(name, main_dir, None), 0)
    out.missing = sorted(missing)
    return out


def _directory(path: str) -> str:
    """`path` without trailing slashes ("/" stays "/"), so `f"{dir}/{name}"` is a join."""
    return path.rstrip("/") or "/"


def _candidates(d: Directive, here: _File, paths: Sequence[str]) -> list[tuple[str, int | None]]:
    name = d.spelling
    if name.startswith("/"):
        return [(name, None)]
    if d.next and here.index is not None:
        return [(f"{p}/{name}", i) for i, p in enumerate(paths) if i > here.index]
    found: list[tuple[str, int | None]] = [(f"{here.directory}/{name}", None)] if d.quoted else []
    found += [(f"{p}/{name}", i) for i, p in enumerate(paths)]
    return found


def _read_header(path: str) -> tuple[bytes, tuple[int, int, str]]:
    """A header's bytes and identity (its file, and the directory its includes start in).

    O_NONBLOCK: a FIFO planted at a header path never blocks the resolver.
    """
    fd = os.open(path, os.O_RDONLY | O_NONBLOCK | O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unfollowable(f"{path} is not a regular file")
        data = read_all(fd, st.st_size)
    finally:
        os.close(fd)
    return data, (st.st_dev, st.st_ino, os.path.normpath(os.path.dirname(path)))
