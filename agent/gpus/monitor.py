"""GpuMonitor: the trio service that owns a node's GPU view.

Tree of tasks (all in one nursery, living as long as ``run``)::

    run ── discovery (worker thread, bounded) ── kernel-log back-fill ── first poll
        ├── _poll_loop   every poll_interval_s (or at once when kicked): backend.poll()
        │                in a worker thread (bounded, abandoned on timeout)
        ├── _event_loop  backend.wait_events(event_wait_ms) in a worker thread, forever
        └── _owner_loop  the only task that mutates per-GPU state: applies polls and
                         events, classifies (pure), rebuilds the snapshot, publishes

Fault injection (simulated backends) goes through the backend's raw signals and
event queue, then kicks a poll: the same path NVML data takes.
"""

from __future__ import annotations

import logging
import socket
import statistics as stats
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from scheduler_link.messages import GpuInfo, GpuSnapshot, HostHealth

from .backend import Discovery, GpuBackend, GpuSample, RawEvent
from .classify import (
    SEVERITY_RANK,
    STATE_OF_RANK,
    GpuObservation,
    HealthConfig,
    XidEvent,
    classify_gpu,
    classify_inventory,
    reasons_key,
    xid_class,
)
from .errors import FaultError, GpuBackendError
from .faults import Fault
from .host import HostReadings, classify_host, read_host
from .kmsg import boot_time, read_kernel_log, xids_from_lines

log = logging.getLogger("herd.agent.gpus")

_HISTORY_MAX = 4096
_HISTORY_BUCKETS = 120          # entries per shortest window
_RECENT_XIDS_MAX = 1024


@dataclass(slots=True)
class _GpuState:
    info: GpuInfo
    sample: GpuSample | None = None
    history: deque[tuple[float, Any]] = field(default_factory=lambda: deque(maxlen=_HISTORY_MAX))
    fatal_xids: dict[int, XidEvent] = field(default_factory=dict)
    recent_xids: deque[XidEvent] = field(default_factory=lambda: deque(maxlen=_RECENT_XIDS_MAX))
    last_xid: int | None = None
    xid_counts: dict[str, int] = field(default_factory=dict)
    health: str = "healthy"
    reasons: list[Any] = field(default_factory=list)


class GpuMonitor:
    """Discovery, polling, events and classification for one host's GPUs.

    ``snapshot()`` is cheap (the latest prebuilt value); ``subscribe()`` yields a new
    snapshot whenever any GPU's (or the host's) health state or reasons change.
    """

    def __init__(self, backend: GpuBackend, *, poll_interval_s: float = 1.0,
                 health_config: HealthConfig = HealthConfig(), state_dir: Path | None = None,
                 discovery_timeout_s: float = 60.0, poll_timeout_s: float = 10.0,
                 event_wait_ms: int = 200, kernel_log: bool = True,
                 clock: Callable[[], float] = time.time) -> None:
        if poll_interval_s <= 0:
            raise ValueError("poll_interval_s must be > 0")
        self.backend = backend
        self.poll_interval_s = poll_interval_s
        self.cfg = health_config
        self.state_dir = state_dir
        self.discovery_timeout_s = discovery_timeout_s
        self.poll_timeout_s = poll_timeout_s
        self.event_wait_ms = event_wait_ms
        self.kernel_log = kernel_log
        self._clock = clock
        self._hostname = backend.hostname or socket.gethostname()
        self._discovery: Discovery | None = None
        self._discovery_abandoned = False
        self._gpus: dict[str, _GpuState] = {}
        self._host = HostHealth()
        self._snapshot = GpuSnapshot(hostname=self._hostname, backend=backend.spec, simulated=backend.simulated)
        self._health_key: Any = None
        self._subscribers: list[trio.MemorySendChannel[GpuSnapshot]] = []
        self._kick_send, self._kick_recv = trio.open_memory_channel[None](1)
        self._obs_send, self._obs_recv = trio.open_memory_channel[tuple[str, Any, Any, float]](64)
        self._poll_limiter = trio.CapacityLimiter(1)
        self._event_limiter = trio.CapacityLimiter(1)
        self._poll_ms: deque[float] = deque(maxlen=512)
        self._stats: dict[str, int] = {"polls": 0, "poll_timeouts": 0, "poll_errors": 0, "events": 0,
                                       "xids": 0, "kmsg_xids": 0, "unattributed_events": 0, "injected": 0,
                                       "health_changes": 0, "published": 0, "dropped": 0,
                                       "event_errors": 0, "signal_errors": 0}

    # ------------------------------------------------------------ public API

    def snapshot(self) -> GpuSnapshot:
        return self._snapshot

    def subscribe(self, buffer: int = 64) -> trio.MemoryReceiveChannel[GpuSnapshot]:
        send, recv = trio.open_memory_channel[GpuSnapshot](buffer)
        self._subscribers.append(send)
        return recv

    def inject(self, uuid: str, fault: Fault) -> None:
        """Feed raw signals into a simulated GPU; health follows through the normal path."""
        if not self.backend.simulated:
            raise GpuBackendError(f"fault injection needs simulated GPUs; this node's backend is "
                                  f"{self.backend.spec!r} (real GPUs are never faked)")
        if uuid not in self._gpus:
            raise FaultError(f"no GPU {uuid} on this node")
        self.backend.inject(uuid, fault)
        self._stats["injected"] += 1
        log.info("fault injected gpu=%s fault=%s", uuid, fault.describe())
        self._kick()

    def statistics(self) -> dict[str, Any]:
        ms = list(self._poll_ms)
        return {
            "backend": self.backend.spec, "simulated": self.backend.simulated, "gpus": len(self._gpus),
            **self._stats,
            "poll_ms_last": round(ms[-1], 3) if ms else None,
            "poll_ms_p50": round(stats.median(ms), 3) if ms else None,
            "poll_ms_max": round(max(ms), 3) if ms else None,
            "subscribers": len(self._subscribers),
            "signals_failing": {u: g.sample.failed_signals for u, g in self._gpus.items()
                                if g.sample is not None and g.sample.failed_signals},
            "health": {s: sum(1 for g in self._gpus.values() if g.health == s)
                       for s in ("healthy", "degraded", "fatal")},
        }

    # ------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[GpuSnapshot] = trio.TASK_STATUS_IGNORED) -> None:
        self._discovery_abandoned = False
        try:
            disc = await self._discover()
            self._discovery = disc
            self._gpus = {g.uuid: _GpuState(info=g) for g in disc.gpus}
            if self.kernel_log:
                await self._backfill()
            first = await self._poll_blocking_bounded()
            if first is not None:
                self._apply_poll(first[0], first[1], first[2])
            self._rebuild()
            log.info("gpus discovered backend=%s simulated=%s count=%d driver=%s", self.backend.spec,
                     self.backend.simulated, len(self._gpus), disc.driver_version)
            async with trio.open_nursery() as n:
                n.start_soon(self._owner_loop)
                n.start_soon(self._poll_loop)
                n.start_soon(self._event_loop)
                task_status.started(self._snapshot)
        finally:
            for s in self._subscribers:
                s.close()
            self._subscribers.clear()
            if not self._discovery_abandoned:   # never close under a discovery thread still in the driver
                await self._close_backend()

    async def _close_backend(self) -> None:
        # An abandoned poll thread keeps its limiter token until its C call returns: wait a
        # little for it so the library is not shut down under a running call.
        with trio.CancelScope(shield=True), trio.move_on_after(2.0) as cs:
            async with self._poll_limiter:
                self.backend.close()
        if cs.cancelled_caught:
            log.warning("gpu backend not closed: a poll is still stuck in the driver")

    async def _discover(self) -> Discovery:
        try:
            with trio.fail_after(self.discovery_timeout_s):
                return await trio.to_thread.run_sync(self.backend.discover, abandon_on_cancel=True)
        except trio.Cancelled:
            self._discovery_abandoned = True
            raise
        except trio.TooSlowError:
            self._discovery_abandoned = True
            raise GpuBackendError(f"GPU discovery ({self.backend.spec}) took longer than "
                                  f"{self.discovery_timeout_s:g}s; the driver may be hung") from None

    async def _backfill(self) -> None:
        pci = {g.info.pci_bus_id: u for u, g in self._gpus.items() if g.info.pci_bus_id}
        lines: list[str] = []
        with trio.move_on_after(5.0):
            lines = await trio.to_thread.run_sync(read_kernel_log, abandon_on_cancel=True)
        if not lines:
            return
        bt = await trio.to_thread.run_sync(boot_time)
        evs = xids_from_lines(lines, boot_time=bt, pci_to_uuid=pci, now=self._clock())
        self._stats["kmsg_xids"] += len(evs)
        if evs:
            log.warning("kernel log back-fill xids=%d", len(evs))
            self._apply_events(evs, self._clock())

    def _poll_blocking(self) -> tuple[list[GpuSample], HostReadings]:
        samples = self.backend.poll()
        return samples, read_host(self.state_dir)

    async def _poll_blocking_bounded(self) -> tuple[list[GpuSample], HostReadings, float] | None:
        t0 = time.perf_counter()
        result = None
        with trio.move_on_after(self.poll_timeout_s) as cs:
            try:
                result = await trio.to_thread.run_sync(self._poll_blocking, abandon_on_cancel=True,
                                                       limiter=self._poll_limiter)
            except Exception:  # a backend bug must not kill the monitor: count it, keep the last view
                self._stats["poll_errors"] += 1
                log.exception("gpu poll failed backend=%s", self.backend.spec)
                return None
        if cs.cancelled_caught:
            self._stats["poll_timeouts"] += 1
            log.warning("gpu poll took longer than %gs; abandoned", self.poll_timeout_s)
            return None
        self._poll_ms.append((time.perf_counter() - t0) * 1000.0)
        self._stats["polls"] += 1
        assert result is not None
        return result[0], result[1], self._clock()

    async def _poll_loop(self) -> None:
        while True:
            with trio.move_on_after(self.poll_interval_s):
                await self._kick_recv.receive()
            r = await self._poll_blocking_bounded()
            if r is not None:
                await self._obs_send.send(("poll", r[0], r[1], r[2]))

    async def _event_loop(self) -> None:
        while True:
            # Not abandoned on cancel: the wait is short, and the backend must not be
            # closed under a thread still waiting on its event set.
            try:
                evs = await trio.to_thread.run_sync(self.backend.wait_events, self.event_wait_ms,
                                                    limiter=self._event_limiter)
            except Exception:  # a backend bug must not take the agent down: polls still run
                self._stats["event_errors"] += 1
                log.exception("gpu event wait failed backend=%s", self.backend.spec)
                await trio.sleep(max(0.1, self.event_wait_ms / 1000.0))
                continue
            if evs:
                await self._obs_send.send(("events", evs, None, self._clock()))

    async def _owner_loop(self) -> None:
        async for kind, a, b, now in self._obs_recv:
            if kind == "poll":
                self._apply_poll(a, b, now)
            else:
                self._apply_events(a, now)
            self._rebuild()

    def _kick(self) -> None:
        try:
            self._kick_send.send_nowait(None)
        except trio.WouldBlock:
            pass

    # ------------------------------------------------------------ state (owner only)

    def _apply_poll(self, samples: list[GpuSample], host: HostReadings, now: float) -> None:
        keep = max(self.cfg.throttle_window_s, self.cfg.counter_window_s)
        # History is bucketed so classification stays cheap at any poll rate: one entry per
        # `step`, holding the bucket's latest counters and the OR of its throttle reasons.
        step = min(self.cfg.throttle_window_s, self.cfg.counter_window_s) / _HISTORY_BUCKETS
        for s in samples:
            g = self._gpus.get(s.uuid)
            if g is None:
                continue
            g.sample = s
            if s.failed_signals:
                self._stats["signal_errors"] += len(s.failed_signals)
            if not (s.lost or s.reset_required):
                tel = s.telemetry
                if g.history and now - g.history[-1][0] < step:
                    t0, prev = g.history.pop()
                    if prev.throttle_reasons and tel.throttle_reasons is not None:
                        tel = msgspec.structs.replace(tel, throttle_reasons=tel.throttle_reasons
                                                      | prev.throttle_reasons)
                    g.history.append((t0, tel))
                else:
                    g.history.append((now, tel))
            while g.history and now - g.history[0][0] > keep:
                g.history.popleft()
        self._host = classify_host(host, self.cfg.host, now)
        if self._discovery is not None:
            inv = classify_inventory(len(self._gpus), self._discovery.unanswered, self.cfg.expected_gpus, now)
            if inv:
                reasons = [*self._host.reasons, *inv]
                state = STATE_OF_RANK[max(SEVERITY_RANK[r.severity] for r in reasons)]
                self._host = msgspec.structs.replace(self._host, reasons=reasons, state=state)
        prev = {(r.code, r.severity): r.since for r in self._snapshot.host.reasons}
        if prev:
            self._host = msgspec.structs.replace(self._host, reasons=[
                msgspec.structs.replace(r, since=prev.get((r.code, r.severity), r.since))
                for r in self._host.reasons])

    def _apply_events(self, events: list[RawEvent], now: float) -> None:
        for ev in events:
            self._stats["events"] += 1
            g = self._gpus.get(ev.uuid) if ev.uuid else None
            if g is None:
                self._stats["unattributed_events"] += 1
                log.warning("gpu event for an unknown device kind=%s value=%d", ev.kind, ev.value)
                continue
            if ev.kind == "xid":
                at = ev.at if ev.at is not None else now
                x = XidEvent(xid=ev.value, at=at, source=ev.source, detail=ev.detail)
                self._stats["xids"] += 1
                g.last_xid = ev.value
                g.xid_counts[str(ev.value)] = g.xid_counts.get(str(ev.value), 0) + 1
                if xid_class(ev.value) == "fatal":
                    g.fatal_xids.setdefault(ev.value, x)
                else:
                    g.recent_xids.append(x)
                log.warning("xid gpu=%s xid=%d class=%s source=%s", ev.uuid, ev.value, xid_class(ev.value),
                            ev.source)
            elif ev.kind == "reset":
                g.fatal_xids.clear()
                g.recent_xids.clear()
                g.history.clear()
                g.xid_counts.clear()
                g.last_xid = None
                log.info("gpu reset gpu=%s source=%s", ev.uuid, ev.source)
            else:
                # DBE, GPU unavailable, recovery action: the counters/flags are read by a poll now.
                self._kick()

    def _observation(self, g: _GpuState, now: float) -> GpuObservation:
        window = max(self.cfg.app_xid_window_s, self.cfg.degraded_xid_window_s)
        while g.recent_xids and now - g.recent_xids[0].at > window:
            g.recent_xids.popleft()
        tel = g.info.telemetry
        return GpuObservation(
            uuid=g.info.uuid, sample=g.sample, xids=list(g.fatal_xids.values()) + list(g.recent_xids),
            history=list(g.history), nvlinks_expected=[ln.link for ln in g.info.nvlinks if ln.active],
            temp_slowdown_c=tel.temp_slowdown_c, temp_shutdown_c=tel.temp_shutdown_c)

    def _rebuild(self) -> None:
        now = self._clock()
        assert self._discovery is not None
        gpus: list[GpuInfo] = []
        for g in self._gpus.values():
            state, reasons = classify_gpu(self._observation(g, now), self.cfg, now, g.reasons)
            if state != g.health:
                self._stats["health_changes"] += 1
                log.warning("gpu health gpu=%s index=%d %s -> %s reasons=%s", g.info.uuid, g.info.index,
                            g.health, state, ",".join(r.code for r in reasons) or "-")
            g.health, g.reasons = state, reasons
            tel = g.sample.telemetry if g.sample is not None else g.info.telemetry
            if tel.temp_slowdown_c is None and tel.temp_shutdown_c is None:
                tel = msgspec.structs.replace(tel, temp_slowdown_c=g.info.telemetry.temp_slowdown_c,
                                              temp_shutdown_c=g.info.telemetry.temp_shutdown_c)
            tel = msgspec.structs.replace(tel, last_xid=g.last_xid, xid_counts=dict(g.xid_counts))
            fabric = g.sample.fabric_health if g.sample is not None and g.sample.fabric_health else g.info.fabric_health
            gpus.append(msgspec.structs.replace(g.info, health=state, reasons=reasons, telemetry=tel,
                                                fabric_health=fabric, simulated=self.backend.simulated))
        d = self._discovery
        self._snapshot = GpuSnapshot(hostname=self._hostname, backend=d.backend, simulated=d.simulated,
                                     driver_version=d.driver_version, cuda_version=d.cuda_version, gpus=gpus,
                                     topology_matrix=d.topology_matrix, nvlink_domain=d.nvlink_domain,
                                     host=self._host, taken_at=now)
        key = (tuple((g.uuid, g.health, reasons_key(g.reasons)) for g in gpus),
               self._host.state, reasons_key(self._host.reasons))
        if key != self._health_key:
            self._health_key = key
            self._publish()

    def _publish(self) -> None:
        self._stats["published"] += 1
        alive = []
        for s in self._subscribers:
            try:
                s.send_nowait(self._snapshot)
                alive.append(s)
            except trio.WouldBlock:
                self._stats["dropped"] += 1
                alive.append(s)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        self._subscribers = alive


async def snapshot_once(backend: GpuBackend, *, health_config: HealthConfig = HealthConfig(),
                        state_dir: Path | None = None, kernel_log: bool = True) -> GpuSnapshot:
    """Discover, back-fill, poll once and return the snapshot (for ``herd gpus``)."""
    mon = GpuMonitor(backend, health_config=health_config, state_dir=state_dir, kernel_log=kernel_log,
                     event_wait_ms=50)
    async with trio.open_nursery() as n:
        snap: GpuSnapshot = await n.start(mon.run)
        n.cancel_scope.cancel()
    return snap
