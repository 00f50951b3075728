"""The docs say what the product does now, and stay small and checkable.

- No tracked file outside ``tests/`` tells how a figure or a change was reached: who ran it
  ("the lead", "the helper's runs"), in which sitting ("session 33", "this session", "the last
  stop") or at which commit ("HEAD 1a2b3c4"). History lives in git. The patterns are phrases,
  not bare words, so a TLS session, a process session (``setsid``), a helper process and a
  workload stop stay legitimate; see ``PHRASES``.
- README.md stays under 15 KB.
- Every JSON key docs/performance.md names is one its bench prints (statically here: the key's
  last name appears in the bench's source; ``make bench-quick`` runs the benches and checks
  their output, ``bench/quick.py``), and every bench it names is one ``bench.quick`` runs.
- Every relative link in README.md and docs/*.md points at a file that exists.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from bench.quick import QUICK, table_keys

ROOT = Path(__file__).resolve().parent.parent

# (name, pattern): each a phrase that tells history instead of the product.
PHRASES: list[tuple[str, re.Pattern[str]]] = [
    ("a numbered session", re.compile(r"\bsessions? \d+", re.I)),
    ("a session as a time", re.compile(r"\b(?:this|last|previous|next|same|earlier|later|that) session\b", re.I)),
    ("a named helper", re.compile(r"\bhelper [A-Z]\b")),
    ("a helper's work", re.compile(r"\bhelpers?(?:'s|')(?=\s)", re.I)),
    ("who ran it", re.compile(r"\((?:lead|helper)\b", re.I)),
    ("the lead", re.compile(r"\bthe lead\b|\blead's\b", re.I)),
    ("a stop as a time", re.compile(r"\b(?:the last|the previous|the next|this|that) stop(?:'s)?(?= final| run|\b(?! ))",
                                    re.I)),
    ("a commit as a time", re.compile(r"\bHEAD [0-9a-f]{7,40}\b|\b(?:commit|tree) [0-9a-f]{7,40}\b")),
]
# Markdown says figures without naming runs or commits at all.
DOC_PHRASES: list[tuple[str, re.Pattern[str]]] = [
    ("a numbered run", re.compile(r"\b[Rr]un (?:#\s*)?\d+\b")),
    ("a commit hash", re.compile(r"(?<![\w/.-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w/.-])")),
]


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if not p.startswith("tests/")]


def hits(path: str, text: str) -> list[str]:
    rules = PHRASES + (DOC_PHRASES if path.endswith(".md") else [])
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for name, rx in rules:
            m = rx.search(line)
            if m:
                found.append(f"{path}:{n}: {name}: {m.group(0)!r}")
    return found


def read(path: str) -> str | None:
    p = ROOT / path
    if not p.is_file() or p.suffix in (".png", ".jpg", ".gz"):
        return None
    try:
        return p.read_text()
    except UnicodeDecodeError:
        return None


def test_no_tracked_file_tells_history() -> None:
    found = []
    for path in tracked():
        text = read(path)
        if text is not None:
            found += hits(path, text)
    assert not found, "\n".join(found)


@pytest.mark.parametrize("line", [
    "session 33 (lead, 3 reps): 1.2 s", "this session's end", "the helper's runs", "two helpers' benches",
    "the placer service (helper F's)", "the lead wires the placer", "The last stop's final: 1.29 s",
    "on HEAD a971c90", "before session 28;",
])
def test_history_phrases_are_caught(line: str) -> None:
    assert hits("x.py", line), line


@pytest.mark.parametrize("line", [
    "No TLS 1.3 session tickets", "in a session of its own", "the shim lives in its own session",
    "Cut points in a helper process", "helpers shared by backends", "A stop (preemption, cancel) persists",
    "herd agent stop --agent URL ID", "the path leads to a root", "HEAD requests are answered",
    "the TLS session objects", "stop the workloads", "the last stop line",
])
def test_product_words_are_not_caught(line: str) -> None:
    assert not hits("x.py", line), hits("x.py", line)


def test_docs_name_no_runs_or_commits() -> None:
    assert hits("x.md", "the batch accept of e8a554d") and hits("x.md", "run 2: 1.3 s")
    assert not hits("x.md", "chunks/ab/<blake3> and 64-hex ids, 1,048,576 GPUs, 2026-12-03")


def test_readme_is_under_15_kb() -> None:
    assert (ROOT / "README.md").stat().st_size <= 15 * 1024


def printable_names(src: str) -> list[re.Pattern[str]]:
    """What a bench's source can print as a JSON key: its string literals, alone or behind a
    prefix (``out[f"{mode}_{k}"]`` over a result's keys), its f-strings (each ``{...}`` standing
    for a word) and its keyword-argument names (``row.update(a=...)``)."""
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(re.escape(node.value))
            if len(node.value) >= 4 and node.value.isidentifier():
                out.append(r"\w+_" + re.escape(node.value))
        elif isinstance(node, ast.JoinedStr):
            texts = [v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None
                     for v in node.values]
            if sum(len(t) for t in texts if t is not None) >= 3:
                out.append("".join(r"\w+" if t is None else re.escape(t) for t in texts))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append(re.escape(node.arg))
    return [re.compile(p) for p in out]


def test_performance_rows_name_keys_their_benches_print() -> None:
    named = table_keys((ROOT / "docs" / "performance.md").read_text())
    assert named and set(named) <= set(QUICK), sorted(set(named) - set(QUICK))
    missing = []
    for module, keys in named.items():
        names = printable_names((ROOT / (module.replace(".", "/") + ".py")).read_text())
        for key in keys:
            last = key.split(".")[-1]
            if not any(rx.fullmatch(last) for rx in names):
                missing.append(f"{module}: {key}")
    assert not missing, missing


def test_the_key_check_catches_a_renamed_key() -> None:
    names = printable_names('out = {"fetch_mb_s": 1, f"{mode}_completion_over_ideal": 2, "node_cpu_s": 3}\n'
                            'row.update(register_s=3)')
    assert all(any(rx.fullmatch(k) for rx in names)
               for k in ("fetch_mb_s", "herd_completion_over_ideal", "register_s", "herd_node_cpu_s"))
    assert not any(rx.fullmatch("fetch_mbps") for rx in names)


def test_relative_links_point_at_files() -> None:
    broken = []
    for doc in [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = re.sub(r"<!--.*?-->", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
