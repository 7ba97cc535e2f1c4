"""`capsafe cache stats|list|prune|clear`: look at and tidy the NVRTC kernel cache."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from capsafe.kernel_cache.settings import settings_from_env
from capsafe.kernel_cache.store import KernelCache

ACTIONS = ("stats", "list", "prune", "clear")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "cache",
        help="show, prune or clear the NVRTC kernel disk cache",
        description=(
            "Inspect the NVRTC kernel disk cache. stats: entries, bytes, budget and the "
            "hit/miss/compile counters summed over every process; list: entries, least "
            "recently used first; prune: evict least-recently-used entries down to the "
            "budget (or --max-bytes); clear: remove every entry and the counters."
        ),
    )
    parser.add_argument("action", choices=ACTIONS, help="what to do")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--dir",
        metavar="PATH",
        help="cache directory (default: CAPSAFE_KERNEL_CACHE_DIR or $XDG_CACHE_HOME/capsafe/nvrtc)",
    )
    parser.add_argument(
        "--max-bytes",
        type=_byte_count,
        metavar="N",
        help="prune: the budget to prune down to (default: CAPSAFE_KERNEL_CACHE_MAX_BYTES)",
    )
    parser.set_defaults(func=run)


def _byte_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (0 = unbounded)")
    return value


def run(args: argparse.Namespace) -> int:
    settings = settings_from_env()
    cache = KernelCache(args.dir or settings.directory, settings.max_bytes, settings.enabled)
    result = {"stats": _stats, "list": _list, "prune": _prune, "clear": _clear}[args.action](
        cache, args
    )
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(_text(args.action, result))
    return 0


def _stats(cache: KernelCache, _args: argparse.Namespace) -> dict[str, Any]:
    entries, size = cache.usage()
    return {
        "directory": str(cache.directory),
        "enabled": cache.enabled,
        "entries": entries,
        "bytes": size,
        "budget_bytes": cache.max_bytes,
        **cache.stats(),
    }


def _list(cache: KernelCache, _args: argparse.Namespace) -> dict[str, Any]:
    rows = [
        {
            "key": e.key,
            "kind": e.kind or "corrupt",
            "name": e.meta.get("name", ""),
            "arch": e.meta.get("arch", ""),
            "nvrtc": e.meta.get("nvrtc", ""),
            "bytes": e.size,
            "last_used": e.mtime,
        }
        for e in cache.entries()
    ]
    return {"directory": str(cache.directory), "entries": rows}


def _prune(cache: KernelCache, args: argparse.Namespace) -> dict[str, Any]:
    budget = cache.max_bytes if args.max_bytes is None else args.max_bytes
    removed, freed = cache.prune(budget)
    entries, size = cache.usage()
    return {
        "budget_bytes": budget,
        "removed": removed,
        "freed_bytes": freed,
        "entries": entries,
        "bytes": size,
    }


def _clear(cache: KernelCache, _args: argparse.Namespace) -> dict[str, Any]:
    return {"directory": str(cache.directory), "removed": cache.clear()}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _text(action: str, r: dict[str, Any]) -> str:
    if action == "stats":
        budget = "unbounded" if r["budget_bytes"] == 0 else f"{_size(r['budget_bytes'])} budget"
        state = "enabled" if r["enabled"] else "disabled (CAPSAFE_KERNEL_CACHE=0)"
        lookups = r["hits"] + r["misses"] - r["waits"]
        rate = f"{100 * r['hits'] / lookups:.0f}% hit rate" if lookups else "no lookups yet"
        return "\n".join(
            [
                f"kernel cache   {r['directory']} ({state})",
                f"entries        {r['entries']} ({_size(r['bytes'])} of {budget})",
                f"lookups        {r['hits']} hits, {r['misses']} misses ({rate}), "
                f"{r['waits']} waited for another process",
                f"compiles       {r['compiles']} ({r['compile_seconds']:.2f} s compiling), "
                f"{r['corrupt']} corrupt entries replaced",
                f"time saved     {r['saved_seconds']:.2f} s of compiling avoided by hits",
            ]
        )
    if action == "list":
        if not r["entries"]:
            return f"no entries in {r['directory']}"
        lines = [f"{'key':16}  {'kind':7}  {'arch':8}  {'size':>10}  {'last used':19}  name"]
        for e in r["entries"]:
            used = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["last_used"]))
            lines.append(
                f"{e['key'][:16]}  {e['kind']:7}  {e['arch']:8}  "
                f"{_size(e['bytes']):>10}  {used}  {e['name']}"
            )
        return "\n".join(lines)
    if action == "prune":
        budget = "unbounded" if r["budget_bytes"] == 0 else _size(r["budget_bytes"])
        return (
            f"pruned {r['removed']} entries ({_size(r['freed_bytes'])}) to fit {budget}; "
            f"{r['entries']} entries ({_size(r['bytes'])}) remain"
        )
    return f"cleared {r['removed']} entries from {r['directory']}"
