"""A full report's encoding (scheduler_link.messages): telemetry at its defaults is left off
the wire, and every decoder, MAC and digest still agrees on what was sent.

What the placer needs of a registration must survive the smaller encoding: the GPUs' UUIDs,
indices, health and reasons, the NVLink domain, ``simulated`` and the inventory digest; and a
GPU's telemetry, where a snapshot carries it (the agent's status API, a health change), must
come back field for field."""

from __future__ import annotations

import time
import types
import typing

import msgspec
import pytest
import trio

from agent.gpus import open_backend, snapshot_once
from scheduler_link.agent_link import registration
from scheduler_link.messages import (
    GpuInfo,
    GpuSnapshot,
    GpuTelemetry,
    HealthReason,
    NodeReport,
    TopologyPath,
    for_placer,
    gpu_inventory,
)
from scheduler_link.msgauth import node_key, report_ok, with_report_mac
from scheduler_link.validate import validate_report
from tests.test_enroll_crypto import Cluster

_frames_enc = msgspec.msgpack.Encoder()     # (the frames channel's settings)
_rep_dec = msgspec.msgpack.Decoder(NodeReport)


def _value(t: object) -> object:
    """A value of field type ``t`` that is not its default (None or empty)."""
    args = [a for a in typing.get_args(t) if a is not type(None)] if isinstance(t, types.UnionType) else [t]
    a = args[0]
    if a is bool:
        return True
    if a is int:
        return 7
    if a is float:
        return 1.5
    if typing.get_origin(a) is dict:
        return {"79": 2, "13": 1}
    raise AssertionError(f"no value for {t!r}")


def every_field() -> GpuTelemetry:
    return GpuTelemetry(**{f.name: _value(f.type) for f in msgspec.structs.fields(GpuTelemetry)})


def _snapshot(profile: str = "dgx-h100") -> GpuSnapshot:
    return trio.run(snapshot_once, open_backend(f"simulated:{profile}", hostname="n1"))


def _full(snap: GpuSnapshot | None) -> NodeReport:
    return NodeReport(node_id="n1", boot_id="b1", seq=4, control_url="http://10.0.0.1:8470",
                      data_url="http://10.0.0.1:8471", topology=TopologyPath(zone="z", block="b", rack="r"),
                      nvlink_domain=snap.nvlink_domain if snap else None, snapshot=snap, manifests=[], sent_at=5.0)


def test_every_telemetry_field_set_travels_and_comes_back() -> None:
    tel = every_field()
    assert all(getattr(tel, f.name) != f.default for f in msgspec.structs.fields(GpuTelemetry))
    assert set(msgspec.json.decode(msgspec.json.encode(tel))) == {f.name for f in msgspec.structs.fields(GpuTelemetry)}
    snap = _snapshot()
    snap = msgspec.structs.replace(snap, gpus=[msgspec.structs.replace(g, telemetry=tel) for g in snap.gpus])
    rep = _full(snap)
    for enc, dec in ((_frames_enc.encode, _rep_dec.decode),
                     (msgspec.json.encode, msgspec.json.Decoder(NodeReport).decode)):
        back = dec(enc(rep))
        assert back == rep
        assert all(g.telemetry == tel for g in back.snapshot.gpus)   # type: ignore[union-attr]


def test_no_telemetry_is_left_off_the_wire_and_decodes_to_the_default() -> None:
    assert msgspec.json.encode(GpuTelemetry()) == b"{}"
    assert msgspec.json.encode(GpuTelemetry(temperature_c=40.0)) == b'{"temperature_c":40.0}'
    g = msgspec.json.decode(b'{"index":0,"uuid":"GPU-1","name":"x","memory_total_mib":1,"pci_bus_id":"0"}',
                            type=GpuInfo)
    assert g.telemetry == GpuTelemetry()
    # what an older agent sends (every field, its nulls too) decodes to the same
    older = b'{"telemetry":{' + b",".join(b'"%s":null' % f.name.encode() for f in msgspec.structs.fields(
        GpuTelemetry) if f.name != "xid_counts") + b',"xid_counts":{}},"index":0,"uuid":"GPU-1","name":"x",' \
        b'"memory_total_mib":1,"pci_bus_id":"0"}'
    assert msgspec.json.decode(older, type=GpuInfo) == g


@pytest.mark.parametrize("profile", ["dgx-h100", "gb200-nvl72"])
def test_a_registration_keeps_what_the_placer_reads(profile: str) -> None:
    snap = _snapshot(profile)
    bad = msgspec.structs.replace(snap.gpus[3], health="fatal", telemetry=every_field(),
                                  reasons=[HealthReason(code="xid:79", severity="fatal", gpu=snap.gpus[3].uuid)])
    snap = msgspec.structs.replace(snap, gpus=[*snap.gpus[:3], bad, *snap.gpus[4:]])
    rep = registration(_full(snap), "")
    raw = _frames_enc.encode(rep)
    assert len(raw) < 0.5 * len(_frames_enc.encode(_full(snap)))   # telemetry, NVLinks, the matrix stay home
    back = _rep_dec.decode(raw)
    assert back == rep and validate_report(back) is None
    assert back.snapshot is not None and back.snapshot == for_placer(snap)
    assert gpu_inventory(back.snapshot) == gpu_inventory(snap) and back.inventory == gpu_inventory(snap)[1]
    assert [(g.index, g.uuid, g.health, g.reasons, g.simulated) for g in back.snapshot.gpus] == \
        [(g.index, g.uuid, g.health, g.reasons, g.simulated) for g in snap.gpus]
    assert (back.snapshot.nvlink_domain, back.snapshot.host) == (snap.nvlink_domain, snap.host)


@pytest.mark.parametrize("tel", [GpuTelemetry(), GpuTelemetry(temperature_c=45), every_field()],
                         ids=["none", "one", "every"])
def test_a_relayed_full_reports_mac_verifies_after_the_relays_round_trip(tel: GpuTelemetry) -> None:
    key = node_key(b"m" * 32, "n1", "b1")
    snap = _snapshot()
    snap = msgspec.structs.replace(snap, gpus=[msgspec.structs.replace(g, telemetry=tel) for g in snap.gpus])
    signed = with_report_mac(key, _full(snap))
    seen = _rep_dec.decode(_frames_enc.encode(_rep_dec.decode(_frames_enc.encode(signed))))   # member, relay, placer
    assert report_ok(key, seen)
    changed = msgspec.structs.replace(seen.snapshot.gpus[0].telemetry, power_w=99.0)   # type: ignore[union-attr]
    gpus = [msgspec.structs.replace(seen.snapshot.gpus[0], telemetry=changed), *seen.snapshot.gpus[1:]]  # type: ignore[union-attr]
    assert not report_ok(key, msgspec.structs.replace(seen, snapshot=msgspec.structs.replace(seen.snapshot, gpus=gpus)))


def test_an_enrolments_full_report_reaches_the_desk_as_the_member_made_it() -> None:
    cl = Cluster()
    now = time.time()   # (the certificates are issued now: a clock fixed at the import may be past them)
    snap = _snapshot()
    snap = msgspec.structs.replace(snap, gpus=[*snap.gpus[:7], msgspec.structs.replace(snap.gpus[7], telemetry=every_field())])
    rep = registration(msgspec.structs.replace(_full(snap), sent_at=now), "")
    e, _ = cl.client("n1").make(rep, cl.placer_cert, now=now)
    assert len(e.report) < 4096     # (a DGX H100's: ~3.4 KB)
    got = cl.desk.check(msgspec.msgpack.decode(_frames_enc.encode(e), type=type(e)), now=now)
    assert got.report == rep and validate_report(got.report) is None
