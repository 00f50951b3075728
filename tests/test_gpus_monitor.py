"""GpuMonitor over simulated GPUs: injected raw faults move health through the
states and back where the state is recoverable; subscriptions; metrics; bad input."""

from __future__ import annotations

import pytest
import trio

from agent.gpus import Fault, FaultError, GpuMonitor, HealthConfig, open_backend, render_metrics
from testing.waiting import poll
from tests.prom import value

FAST = HealthConfig(throttle_window_s=0.6, throttle_min_samples=2, throttle_fraction=0.5,
                    counter_window_s=0.6)


async def until(mon, rx, pred):
    snap = mon.snapshot()
    while not pred(snap):
        snap = await rx.receive()
    return snap


def codes(snap, i):
    return [r.code for r in snap.gpus[i].reasons]


async def polls_after(mon, n: int = 3) -> None:
    """Wait until the monitor has polled ``n`` more times (what a poll could change, it has)."""
    before = mon.statistics()["polls"]
    await poll(lambda: mon.statistics()["polls"] >= before + n, 0.02)


async def test_injected_faults_walk_the_states_and_back(tmp_path):
    mon = GpuMonitor(open_backend("simulated:dgx-h100", hostname="sim-1"), poll_interval_s=0.05,
                     health_config=FAST, state_dir=tmp_path, kernel_log=False, event_wait_ms=50)
    with trio.fail_after(15):
        async with trio.open_nursery() as n:
            first = await n.start(mon.run)
            assert first.simulated and first.backend == "simulated:dgx-h100" and first.hostname == "sim-1"
            assert all(g.simulated and g.health == "healthy" for g in first.gpus)
            assert first.host.disk_free_mib is not None
            rx = mon.subscribe()
            u = [g.uuid for g in first.gpus]

            # temperature: degraded at slowdown, fatal at shutdown, back when it cools
            mon.inject(u[0], Fault(temperature_c=90))
            await until(mon, rx, lambda s: codes(s, 0) == ["temperature_slowdown"] and s.gpus[0].health == "degraded")
            mon.inject(u[0], Fault(temperature_c=95))
            await until(mon, rx, lambda s: codes(s, 0) == ["temperature_shutdown"] and s.gpus[0].health == "fatal")
            mon.inject(u[0], Fault(temperature_c=40))
            await until(mon, rx, lambda s: s.gpus[0].health == "healthy")

            # sustained hardware slowdown: degraded, recovers once the window is clean
            mon.inject(u[1], Fault(throttle="hw_slowdown"))
            await until(mon, rx, lambda s: codes(s, 1) == ["throttle_hw"])
            mon.inject(u[1], Fault(throttle="none"))
            await until(mon, rx, lambda s: s.gpus[1].health == "healthy")

            # a fatal XID is sticky until clear (a simulated GPU reset)
            mon.inject(u[2], Fault(xid=79))
            snap = await until(mon, rx, lambda s: s.gpus[2].health == "fatal")
            assert codes(snap, 2) == ["xid:79"] and snap.gpus[2].telemetry.last_xid == 79
            await polls_after(mon)
            assert mon.snapshot().gpus[2].health == "fatal"   # sticky
            mon.inject(u[2], Fault(clear=True))
            snap = await until(mon, rx, lambda s: s.gpus[2].health == "healthy")
            assert snap.gpus[2].telemetry.last_xid is None and snap.gpus[2].reasons == []

            # ECC DBE (counter + event), remap pending/failure, lost GPU: each cleared by clear
            mon.inject(u[3], Fault(ecc_dbe=3))
            snap = await until(mon, rx, lambda s: s.gpus[3].health == "fatal")
            assert codes(snap, 3) == ["ecc_dbe_volatile"] and snap.gpus[3].telemetry.ecc_dbe_volatile == 3
            mon.inject(u[3], Fault(clear=True))
            await until(mon, rx, lambda s: s.gpus[3].health == "healthy")
            mon.inject(u[4], Fault(remap="pending"))
            await until(mon, rx, lambda s: codes(s, 4) == ["row_remap_pending"])
            mon.inject(u[4], Fault(remap="failure"))
            await until(mon, rx, lambda s: codes(s, 4) == ["row_remap_failure"] and s.gpus[4].health == "fatal")
            mon.inject(u[5], Fault(lost=True))
            snap = await until(mon, rx, lambda s: codes(s, 5) == ["gpu_lost"])
            assert snap.gpus[5].telemetry.temperature_c is None
            for i in (4, 5):
                mon.inject(u[i], Fault(clear=True))
            await until(mon, rx, lambda s: s.gpus[4].health == s.gpus[5].health == "healthy")

            # an NVLink going down, NVLink error growth: degraded, back when the link returns / window passes
            mon.inject(u[6], Fault(nvlink_down=5, nvlink_errors=7))
            snap = await until(mon, rx, lambda s: set(codes(s, 6)) == {"nvlink_down:5", "nvlink_errors"})
            assert snap.gpus[6].health == "degraded"
            await until(mon, rx, lambda s: codes(s, 6) == ["nvlink_down:5"])   # growth aged out
            mon.inject(u[6], Fault(clear=True))
            await until(mon, rx, lambda s: s.gpus[6].health == "healthy")

            # application XIDs: blamed on the workload, then degraded when they recur
            for _ in range(3):
                mon.inject(u[7], Fault(xid=13))
            snap = await until(mon, rx, lambda s: codes(s, 7) == ["xid_recurring:13"])
            assert snap.gpus[7].health == "degraded" and snap.gpus[7].telemetry.xid_counts == {"13": 3}
            # an unknown XID: degraded with its code shown
            mon.inject(u[0], Fault(xid=999))
            snap = await until(mon, rx, lambda s: codes(s, 0) == ["xid:999"])
            assert snap.gpus[0].health == "degraded" and "999" in snap.gpus[0].reasons[0].detail

            # bad input loses nothing
            with pytest.raises(FaultError, match="no GPU"):
                mon.inject("GPU-sim-nope", Fault(xid=79))
            with pytest.raises(FaultError, match="no link 18"):
                mon.inject(u[1], Fault(nvlink_down=18))
            with pytest.raises(FaultError, match="fabric"):
                mon.inject(u[1], Fault(fabric_health="unhealthy"))
            await polls_after(mon)
            assert mon.snapshot().gpus[1].health == "healthy"

            st = mon.statistics()
            assert st["simulated"] and st["gpus"] == 8 and st["injected"] >= 20 and st["polls"] > 5
            assert st["health"] == {"healthy": 6, "degraded": 2, "fatal": 0}
            text = render_metrics(mon.snapshot(), "sim-1")
            assert value(text, "herd_gpu_simulated", gpu="0", simulated="true", node="sim-1") == 1
            assert value(text, "herd_gpu_health", gpu="7", uuid=u[7], state="healthy") is not None
            n.cancel_scope.cancel()


async def test_nvl72_fabric_health_and_subscriptions_close_at_exit():
    mon = GpuMonitor(open_backend("simulated:gb200-nvl72,rack=r1", hostname="tray"), poll_interval_s=0.05,
                     kernel_log=False, event_wait_ms=50)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            first = await n.start(mon.run)
            assert first.nvlink_domain and all(g.fabric_health == "healthy" for g in first.gpus)
            rx = mon.subscribe()
            mon.inject(first.gpus[0].uuid, Fault(fabric_health="unhealthy"))
            snap = await until(mon, rx, lambda s: s.gpus[0].health == "fatal")
            assert codes(snap, 0) == ["fabric_unhealthy"] and snap.gpus[0].fabric_health == "unhealthy"
            mon.inject(first.gpus[0].uuid, Fault(fabric_health="limited_capacity"))
            await until(mon, rx, lambda s: codes(s, 0) == ["fabric_limited"])
            n.cancel_scope.cancel()
        # the run ended: subscribers see the end of the stream
        async for _ in rx:
            pass


async def test_slow_discovery_is_bounded():
    import threading

    b = open_backend("simulated:l40s-pcie")
    orig = b.discover
    stuck = threading.Event()   # the driver call returns once this is set: after the test

    def slow():
        stuck.wait(30)
        return orig()

    b.discover = slow  # type: ignore[method-assign]
    mon = GpuMonitor(b, discovery_timeout_s=0.1, kernel_log=False)
    from agent.gpus import GpuBackendError
    try:
        with trio.fail_after(5):
            with pytest.raises(GpuBackendError, match="discovery .* took longer than 0.1s"):
                await mon.run()
    finally:
        stuck.set()


async def test_kernel_log_back_fill_reaches_the_first_snapshot(monkeypatch):
    """The kernel log is an external source: a fake reader hands the monitor two lines."""
    import agent.gpus.monitor as m

    lines = ["4,10,5000000,-;NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off",
             "[   7.000000] NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=python, Graphics Exception"]
    monkeypatch.setattr(m, "read_kernel_log", lambda: lines)
    import time
    booted = time.time() - 60.0
    monkeypatch.setattr(m, "boot_time", lambda: booted)
    mon = GpuMonitor(open_backend("simulated:dgx-h100", hostname="k"), poll_interval_s=0.05, event_wait_ms=50)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            snap = await n.start(mon.run)
            assert snap.gpus[1].health == "fatal" and snap.gpus[1].reasons[0].code == "xid:79"
            assert snap.gpus[1].reasons[0].since == booted + 5.0
            assert snap.gpus[0].health == "healthy" and snap.gpus[0].reasons[0].severity == "application"
            assert mon.statistics()["kmsg_xids"] == 2
            n.cancel_scope.cancel()


def test_the_real_kernel_log_reader_is_bounded_and_best_effort():
    import time

    from agent.gpus.kmsg import read_kernel_log
    t0 = time.monotonic()
    lines = read_kernel_log(max_records=1000, timeout_s=1.0)
    assert time.monotonic() - t0 < 5.0
    assert isinstance(lines, list) and all("NVRM" in ln for ln in lines)


async def test_a_hung_poll_is_abandoned_and_the_monitor_keeps_going():
    import threading

    b = open_backend("simulated:l40s-pcie")
    orig = b.poll
    hang = threading.Event()
    unstick = threading.Event()
    closed: list[bool] = []

    def hanging_poll():
        if hang.is_set():
            hang.clear()
            unstick.wait(30)           # a driver call stuck until the test lets it return
        return orig()

    b.poll = hanging_poll  # type: ignore[method-assign]
    b.close = lambda: closed.append(not hang.is_set())  # type: ignore[method-assign]
    mon = GpuMonitor(b, poll_interval_s=0.02, poll_timeout_s=0.1, kernel_log=False, event_wait_ms=20)
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            await n.start(mon.run)
            hang.set()
            await poll(lambda: mon.statistics()["poll_timeouts"] != 0, 0.02)
            unstick.set()
            before = mon.statistics()["polls"]
            await poll(lambda: mon.statistics()["polls"] >= before + 3, 0.02)  # polls resume after the stuck one returns
            assert mon.snapshot().gpus[0].health == "healthy"
            n.cancel_scope.cancel()
    assert closed == [True]
