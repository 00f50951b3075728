"""scheduler_link.validate.validate_report: reports the model cannot take are refused
with one line, real reports pass (issue 16)."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_link.messages import (
    GpuInfo,
    GpuSnapshot,
    HealthReason,
    NodeReport,
    TopologyPath,
    WorkloadEvent,
    WorkloadStatus,
)
from scheduler_link.validate import MAX_GPUS_PER_NODE, validate_report


def _snap(n: int = 8, node: str = "n1") -> GpuSnapshot:
    return GpuSnapshot(simulated=True, gpus=[GpuInfo(index=i, uuid=f"GPU-{node}-{i}", name="sim", memory_total_mib=1,
                                                     pci_bus_id=str(i), simulated=True) for i in range(n)])


def _report(**kw) -> NodeReport:
    base = dict(node_id="n1", boot_id="boot-1", seq=3, full=True, control_url="http://10.0.0.1:8470",
                data_url="http://10.0.0.1:8471", topology=TopologyPath(zone="z", block="b", rack="r"),
                snapshot=_snap(), sent_at=1.0,
                workloads=[WorkloadStatus(workload_id="w1", job_id="j1", gpus=["GPU-n1-0", "GPU-n1-1"])],
                events=[WorkloadEvent(workload_id="w1", job_id="j1", state="running", at=1.0)],
                manifests=["ab" * 32])
    base.update(kw)
    return NodeReport(**base)


def test_the_placer_and_the_validator_agree_on_gpus_per_node() -> None:
    from placer.topology import MAX_GPUS_PER_NODE as placer_max
    assert MAX_GPUS_PER_NODE == placer_max


def test_good_reports_pass() -> None:
    assert validate_report(_report()) is None
    assert validate_report(_report(snapshot=_snap(MAX_GPUS_PER_NODE))) is None
    assert validate_report(_report(snapshot=None, full=False, workloads=[], manifests=None)) is None
    assert validate_report(_report(control_url="http://n1", data_url="")) is None   # no data plane


def test_a_real_agent_snapshot_passes() -> None:
    import trio

    from agent.gpus import open_backend, snapshot_once
    for profile in ("dgx-h100", "gb200-nvl72"):
        snap = trio.run(snapshot_once, open_backend(f"simulated:{profile}", hostname="n1"))
        assert validate_report(_report(snapshot=snap, workloads=[])) is None, profile


def _gpu(i: int, uuid: str | None = None) -> GpuInfo:
    return GpuInfo(index=i, uuid=f"GPU-{i}" if uuid is None else uuid, name="sim", memory_total_mib=1, pci_bus_id=str(i))


@pytest.mark.parametrize("change, words", [
    # the crash of issue 16: more GPUs than the model's owner array holds
    (dict(snapshot=_snap(MAX_GPUS_PER_NODE + 1)), "at most 64"),
    (dict(snapshot=GpuSnapshot(gpus=[_gpu(0, "GPU-a"), _gpu(1, "GPU-a")])), "appears twice"),
    (dict(snapshot=GpuSnapshot(gpus=[_gpu(0, "GPU-a"), _gpu(0, "GPU-b")])), "index 0 appears twice"),
    (dict(snapshot=GpuSnapshot(gpus=[_gpu(64)])), "outside 0..63"),
    (dict(snapshot=GpuSnapshot(gpus=[_gpu(-1)])), "outside 0..63"),
    (dict(snapshot=GpuSnapshot(gpus=[_gpu(0, "")])), "GPU uuid"),
    (dict(snapshot=GpuSnapshot(gpus=[_gpu(0, "GPU a")])), "GPU uuid"),
    (dict(snapshot=GpuSnapshot(gpus=[_gpu(0)], topology_matrix=[["X", "NV18"]])), "1 x 1"),
    (dict(snapshot=GpuSnapshot(gpus=[msgspec.structs.replace(_gpu(0), reasons=[
        HealthReason(code="x", severity="info")] * 65)])), "health reasons"),
    (dict(snapshot=msgspec.structs.replace(_snap(), taken_at=math.nan)), "finite"),
    (dict(node_id=""), "node_id"),
    (dict(node_id="a/b"), "node_id"),
    (dict(node_id="x" * 254), "node_id"),
    (dict(node_id="bad id"), "node_id"),
    (dict(boot_id="b" * 300), "boot_id"),
    (dict(seq=-1), "seq"),
    (dict(version=99), "version"),
    (dict(control_url="file:///etc/passwd"), "control_url"),
    (dict(control_url="http://user:pw@host:1"), "user info"),
    (dict(data_url="http://h:99999"), "data_url"),
    (dict(data_url="http://h:1/\n"), "data_url"),
    (dict(data_url="http://" + "h" * 3000), "data_url"),
    (dict(topology=TopologyPath(zone="", block="b", rack="r")), "zone"),
    (dict(topology=TopologyPath(zone="z", block="b", rack="r" * 200)), "rack"),
    (dict(sent_at=math.inf), "sent_at"),
    (dict(sent_at=math.nan), "sent_at"),
    (dict(workloads=[WorkloadStatus(workload_id="w", job_id="j")] * 2), "appears twice"),
    (dict(workloads=[WorkloadStatus(workload_id=f"w{i}", job_id="j") for i in range(4097)]), "workloads"),
    (dict(workloads=[WorkloadStatus(workload_id="w", job_id="j", gpus=["g", "g"])]), "distinct"),
    (dict(workloads=[WorkloadStatus(workload_id="", job_id="j")]), "workload_id"),
    (dict(workloads=[WorkloadStatus(workload_id="w", job_id="j", created_at=math.nan)]), "created_at"),
    (dict(events=[WorkloadEvent(workload_id="w", job_id="j", state="running", at=math.nan)]), "at must"),
    (dict(events=[WorkloadEvent(workload_id="w", job_id="j", state="running", at=1.0)] * 4097), "events"),
    (dict(events=[WorkloadEvent(workload_id="w", job_id="j", state="exited", at=1.0,
                                bytes_from_origin=-5)]), "bytes_from_origin"),
    (dict(manifests=["../../etc"]), "manifest id"),
    (dict(manifests=["ab" * 32] * 65_537), "manifests"),
])
def test_bad_reports_are_refused_with_a_reason(change: dict, words: str) -> None:
    reason = validate_report(_report(**change))
    assert reason is not None and words in reason, reason


def test_a_decoded_hostile_report_is_refused_not_raised() -> None:
    """What the placer does with the bytes of issue 16's crash frame: decode, validate."""
    raw = msgspec.json.encode(_report(snapshot=_snap(65)))
    rep = msgspec.json.decode(raw, type=NodeReport)
    assert "65 GPUs" in (validate_report(rep) or "")


_txt = st.text(max_size=30)
_num = st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True))
_gpu = st.fixed_dictionaries({"index": st.integers(-3, 70), "uuid": _txt, "name": _txt,
                              "memory_total_mib": st.integers(-5, 2**40), "pci_bus_id": _txt},
                             optional={"nvlinks": st.lists(st.fixed_dictionaries({"link": st.integers(),
                                                                                  "active": st.booleans()}), max_size=3),
                                       "reasons": st.lists(st.fixed_dictionaries(
                                           {"code": _txt, "severity": st.sampled_from(["fatal", "info"])}), max_size=3)})
_report_dict = st.fixed_dictionaries(
    {"node_id": _txt, "boot_id": _txt, "seq": st.integers(-5, 2**63 - 1)},
    optional={"full": st.booleans(), "version": st.integers(-1, 3), "control_url": _txt, "data_url": _txt,
              "topology": st.fixed_dictionaries({}, optional={"zone": _txt, "block": _txt, "rack": _txt}),
              "nvlink_domain": st.none() | _txt, "sent_at": _num,
              "snapshot": st.none() | st.fixed_dictionaries({"gpus": st.lists(_gpu, max_size=70)},
                                                            optional={"topology_matrix": st.lists(
                                                                st.lists(_txt, max_size=3), max_size=3),
                                                                "taken_at": _num}),
              "workloads": st.lists(st.fixed_dictionaries({"workload_id": _txt, "job_id": _txt},
                                                          optional={"gpus": st.lists(_txt, max_size=4),
                                                                    "created_at": _num}), max_size=4),
              "events": st.lists(st.fixed_dictionaries({"workload_id": _txt, "job_id": _txt,
                                                        "state": st.sampled_from(["running", "exited"]),
                                                        "at": _num}), max_size=4),
              "manifests": st.none() | st.lists(_txt, max_size=4)})


@settings(max_examples=300, deadline=None)
@given(d=_report_dict)
def test_validate_report_never_raises_and_accepts_only_what_the_model_can_take(d: dict) -> None:
    try:
        rep = msgspec.convert(d, NodeReport)
    except msgspec.ValidationError:
        return
    why = validate_report(rep)
    assert why is None or (isinstance(why, str) and why and "\n" not in why)
    if why is None and rep.snapshot is not None:
        uuids = [g.uuid for g in rep.snapshot.gpus]
        assert len(uuids) <= MAX_GPUS_PER_NODE and len(set(uuids)) == len(uuids)
        assert len({g.index for g in rep.snapshot.gpus}) == len(uuids)
        assert all(0 <= g.index < MAX_GPUS_PER_NODE for g in rep.snapshot.gpus)
    if why is None:
        assert math.isfinite(rep.sent_at) and rep.node_id and "/" not in rep.node_id


# URLs close to what agents send, and to what must be refused: the fast form's edges
_url_part = st.text(alphabet="aZ09.-_~[]:@%?#/ \t\x00\u00e9", max_size=12)
_urls = st.builds(lambda scheme, host, port, path: f"{scheme}{host}{port}{path}",
                  st.sampled_from(["http://", "https://", "HTTP://", "ftp://", "http:/", "http:", ""]),
                  st.one_of(st.sampled_from(["10.0.0.1", "n1", "a-b.example", "[::1]", "", "u:p@h", "h..", "-h"]),
                            _url_part),
                  st.one_of(st.just(""), st.one_of(st.sampled_from([0, 80, 65535, 65536, 99999, 100_000]), st.integers(-1, 100_000)).map(lambda p: f":{p}"), _url_part.map(":".__add__)),
                  st.one_of(st.just(""), _url_part, st.sampled_from(["/", "/x/y", "/?q", "/#f", "?", "#"])))


@settings(max_examples=1500, deadline=None)
@given(url=_urls)
def test_the_fast_url_check_agrees_with_the_full_parse(url: str) -> None:
    """The common form is taken without urlsplit; every URL gets the full parse's verdict."""
    from scheduler_link.validate import _url, _url_parsed
    assert _url(url, "control_url") == (_url_parsed(url, "control_url") if url else None)   # ("": none)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8470", "https://n1.example:443/base/", "http://n1",
                                 "http://127.0.0.1:9/node-000001", "http://h:0", "http://h:65535"])
def test_agents_urls_are_taken_by_the_fast_form(url: str) -> None:
    from scheduler_link.validate import _PLAIN_URL, _url_parsed
    assert _PLAIN_URL.fullmatch(url) and _url_parsed(url, "control_url") is None


@pytest.mark.parametrize("url", ["http://h/?q", "http://h/x?", "http://h/#f", "http://h#", "http://u@h", "http://u:p@h:1",
                                 "http://h:99999", "http://h:65536", "http://h:-1", "http://h:", "http://h:/x",
                                 "http://[::1]:80", "HTTP://h", "http://h/x y", "http://h/\u00e9", "http://-h",
                                 "http://h\x00", "tcp://h:1", "http:///x", "http://:80"])
def test_urls_at_the_fast_forms_edges_get_the_full_parses_verdict(url: str) -> None:
    from scheduler_link.validate import _url, _url_parsed
    assert _url(url, "data_url") == _url_parsed(url, "data_url")


@pytest.mark.parametrize("change, words", [
    (dict(node_id="n1\n"), "node_id"), (dict(boot_id="boot-1\n"), "boot_id"),
    (dict(topology=TopologyPath(zone="z\n", block="b", rack="r")), "zone"),
    (dict(snapshot=GpuSnapshot(gpus=[GpuInfo(index=0, uuid="GPU-0\n", name="x", memory_total_mib=1, pci_bus_id="0")]),
          workloads=[]), "GPU uuid"), (dict(manifests=["ab" * 32 + "\n"]), "manifest id"),
    (dict(workloads=[WorkloadStatus(workload_id="w1\n", job_id="j1")]), "workload_id"),
])
def test_an_id_with_a_trailing_newline_is_refused(change: dict, words: str) -> None:
    assert words in (validate_report(_report(**change)) or "")


# heads close to what agents send, and to what must be refused: newlines (the fast form's
# separator), spaces, slashes, the length bounds, ports past 65535, URLs with user info
_field = st.one_of(st.sampled_from(["", "n1", "a" * 128, "a" * 129, "a" * 253, "a" * 254, "a" * 256, "a" * 257,
                                    "-n", ".n", "n/1", "n 1", "n\n1", "\n", "z\n", "é", "n@1:x"]),
                   st.text(alphabet="aZ09._:@-/ \n\t\u00e9", max_size=6))


_HEAD = dict(node_id="n1", boot_id="boot-1", zone="z", block="b", rack="r", control_url="http://10.0.0.1:8470",
             data_url="http://10.0.0.1:8471")


@settings(max_examples=1500, deadline=None)
@given(changes=st.lists(st.tuples(st.sampled_from(sorted(_HEAD)), st.one_of(
    _field, _urls, st.just("http://h/" + "x" * 2048))), min_size=1, max_size=3))
def test_the_fast_head_check_takes_only_heads_the_field_checks_take(changes):
    """A head in the agents' form is taken in one match; every other gets the field-by-field
    checks' verdict, so what is refused, and why, is the same either way."""
    from scheduler_link.validate import _head_error, _plain_head
    h = {**_HEAD, **dict(changes)}
    rep = _report(node_id=h["node_id"], boot_id=h["boot_id"], control_url=h["control_url"], data_url=h["data_url"],
                  topology=TopologyPath(zone=h["zone"], block=h["block"], rack=h["rack"]))
    if _plain_head(rep):
        assert _head_error(rep) is None
    assert validate_report(rep) == _head_error(rep)


def test_agents_heads_are_taken_by_the_fast_form() -> None:
    from scheduler_link.validate import _plain_head
    assert _plain_head(_report())
    assert _plain_head(_report(boot_id="", control_url="", data_url="http://127.0.0.1:9/node-000001",
                               node_id="a" * 253, topology=TopologyPath(zone="z" * 128, block="b", rack="r")))
    assert not _plain_head(_report(control_url="http://h:65536"))
    assert not _plain_head(_report(topology=TopologyPath(zone="z\nz", block="b", rack="r")))
