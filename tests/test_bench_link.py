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


def test_e2e_pod_stamps_split_the_agents_side() -> None:
    from bench.link import _pod_stamps

    pods = [{"timings": {"accepted": 10.004, "running": 10.012}}, {"timings": {"accepted": 10.003, "running": 10.019}}]
    out = _pod_stamps(pods, 10.0)
    assert {k: round(v, 3) for k, v in out.items()} == {"pod_accepted": 3.0, "pod_running_first": 12.0,
                                                       "pod_running_last": 19.0}
    # a pod whose running stamp is missing: no last-pod figure (it would be the wrong pod's)
    assert set(_pod_stamps([*pods, {"timings": {"accepted": 10.001}}], 10.0)) == {"pod_accepted"}


def test_state_append_row_times_both_layouts() -> None:
    from bench.link import bench_state_appends

    out = bench_state_appends(rounds=2, writers=2)
    assert out["state_appends"] == 4
    assert out["state_append_p50_ms"] > 0 and out["state_append_growing_p50_ms"] > 0


def test_journal_sync_row_times_both_layouts() -> None:
    from bench.link import bench_journal_syncs

    out = bench_journal_syncs(rounds=2)
    assert out["journal_syncs"] == 2
    assert out["journal_sync_p50_ms"] > 0 and out["journal_sync_growing_p50_ms"] > 0
