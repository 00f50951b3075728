"""bench.quick: the README's performance table parsed into each bench's named JSON keys,
and the key check (the benches themselves run in ``make bench-quick``, not here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.quick import QUICK, missing, table_keys

ROOT = Path(__file__).resolve().parent.parent

TABLE = """\
## Performance

| what | figure | target | reproduce |
|---|---|---|---|
| a | 1 | — | `python -m bench.link` `fanout_1000_ms` `naive.placed` |
| b | 2 | — | same `rows[].tree.x` |
| c | 3 | — | `python -m bench.herd --nodes 8` (root) `herd_speedup` |

after the table
"""


def test_rows_name_their_bench_and_keys() -> None:
    assert table_keys(TABLE) == {"bench.link": ["fanout_1000_ms", "naive.placed", "rows[].tree.x"],
                                 "bench.herd": ["herd_speedup"]}


def test_a_row_naming_no_bench_is_refused() -> None:
    with pytest.raises(SystemExit, match="names no bench"):
        table_keys(TABLE.replace("`python -m bench.herd --nodes 8` (root)", "by hand"))


def test_nested_and_per_row_keys() -> None:
    out = {"naive": {"placed": 3}, "rows": [{"tree": {"x": 1}}, {"tree": {}}], "empty": []}
    assert missing(out, "naive.placed") is None
    assert missing(out, "naive.agree") == "no 'naive.agree'"
    assert missing(out, "rows[].tree.x") == "no 'rows[1].tree.x'"
    assert missing(out, "empty[].a") == "'empty' is not a non-empty list"


def test_the_performance_doc_names_only_benches_quick_runs() -> None:
    named = table_keys((ROOT / "docs" / "performance.md").read_text())
    assert named and set(named) <= set(QUICK)
    assert set(QUICK) == {f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py")
                          if p.stem not in ("__init__", "quick", "fleet_helper", "fleet_tls", "netns")}
