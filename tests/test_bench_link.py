"""bench.link's model-ingest row on a small fleet: the reports it times change the model
(the bench checks the fleet fills and then empties; here it must run and count)."""

from __future__ import annotations

from bench.link import bench_ingest_model


def test_model_ingest_row_runs_and_counts_every_kind() -> None:
    out = bench_ingest_model(n_nodes=64, seconds=0.01, max_rounds=1)
    assert out["ingest_model_rounds"] == 1 and out["ingest_model_nodes"] == 64
    for kind in ("events", "full", "exits"):
        assert out[f"ingest_model_{kind}_per_s"] > 0
        assert out[f"ingest_model_{kind}_decode_only_per_s"] > 0


def test_part_save_row_times_both_layouts() -> None:
    from bench.link import bench_part_saves

    out = bench_part_saves(rounds=2, writers=2)
    assert out["part_saves"] == 4
    assert out["part_save_p50_ms"] > 0 and out["part_save_file_per_part_p50_ms"] > 0
