"""Cluster model: a node's health and drain marks (ClusterModel.set_node_state). A promoted
placer hears the whole fleet again at once: a mark that does not change costs no recomputation
of the node's usable GPUs; one that does is applied as before."""

from __future__ import annotations

import numpy as np

from placer import ClusterModel, NodeSpec


class CountingModel(ClusterModel):
    """The model, counting the rows its usable GPUs are recomputed for."""

    recomputed = 0

    def _recompute_usable(self, rows: np.ndarray | slice | None = None) -> None:
        if isinstance(rows, np.ndarray):
            self.recomputed += rows.size
        super()._recompute_usable(rows)


def _model() -> CountingModel:
    m = CountingModel.build([NodeSpec(f"z0b0r0n{n}", "z0", "b0", "r0", 8) for n in range(4)])
    assert isinstance(m, CountingModel)
    m.assign("j", "z0b0r0n0", [0, 1], priority=0, preemptible=True)
    return m


def test_an_unchanged_mark_recomputes_nothing_and_a_changed_one_applies() -> None:
    m = _model()
    for _ in range(3):   # (every node heard again, up and not draining: as it was)
        for n in range(4):
            m.set_node_state(f"z0b0r0n{n}", healthy=True, draining=False)
    assert m.recomputed == 0 and m.free_gpus("z0b0r0n1") == list(range(8))
    m.set_node_state("z0b0r0n1", healthy=False)
    assert m.recomputed == 1 and m.free_gpus("z0b0r0n1") == []
    m.set_node_state("z0b0r0n1", healthy=False)
    assert m.recomputed == 1
    m.set_node_state("z0b0r0n2", healthy=True, draining=True)
    assert m.recomputed == 2 and m.free_gpus("z0b0r0n2") == []
    m.set_node_state("z0b0r0n1", healthy=True)
    m.set_node_state("z0b0r0n2", healthy=True)
    assert m.recomputed == 4
    assert m.free_gpus("z0b0r0n1") == m.free_gpus("z0b0r0n2") == list(range(8))
    assert m.free_gpus("z0b0r0n0") == list(range(2, 8)) and m.owner_of("z0b0r0n0", 0) == "j"
    m.check_invariants()


def test_marks_set_while_the_model_waits_for_a_rebuild_are_kept() -> None:
    m = _model()
    m.set_node_state("z0b0r0n3", healthy=False)
    m.upsert_node(NodeSpec("z0b0r0n9", "z0", "b0", "r0", 8))   # (the next read rebuilds)
    m.set_node_state("z0b0r0n9", healthy=True, draining=True)
    m.set_node_state("z0b0r0n3", healthy=False)
    assert m.free_gpus("z0b0r0n3") == [] and m.free_gpus("z0b0r0n9") == []
    m.set_node_state("z0b0r0n3", healthy=True)
    assert m.free_gpus("z0b0r0n3") == list(range(8))
    m.check_invariants()
