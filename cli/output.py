"""Shared output helpers: `--json` prints exactly one JSON object; tables otherwise."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import msgspec


def emit_json(obj: Any) -> None:
    sys.stdout.write(msgspec.json.encode(obj).decode() + "\n")
    sys.stdout.flush()


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(text: str) -> int:
    """'1MiB', '256k', '4M', '1048576' -> bytes."""
    t = text.strip().lower().replace("ib", "").replace("b", "")
    mult = 1
    for suf, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30)):
        if t.endswith(suf):
            mult, t = m, t[: -len(suf)]
            break
    return int(float(t) * mult)


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '45s', '2w', '90' (seconds) -> seconds; ValueError otherwise."""
    t = text.strip().lower()
    mult = 1.0
    if t and t[-1] in _DURATION_UNITS:
        mult, t = _DURATION_UNITS[t[-1]], t[:-1]
    value = float(t)
    if not value >= 0 or value == float("inf"):
        raise ValueError(text)
    return value * mult


def human_age(seconds: float) -> str:
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"
