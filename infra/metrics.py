"""Prometheus exposition for both daemons, through ``prometheus_client``.

Each daemon builds one :class:`prometheus_client.CollectorRegistry` of its own (never the
library's global default registry, so two daemons in one process -- the tests, ``herd
demo`` -- never see each other's series) and registers *custom collectors* on it: a
collector reads the owners' ``statistics()`` snapshots at scrape time and turns them into
metric families. Nothing here holds a daemon's state; the owners do, and
:class:`LatencyHistogram` is the one piece of it they keep for us (cumulative bucket
counts, observed by the owner task, read by the collector on the same trio thread).

Exactness: prometheus_client writes every value as a float (``repr``, shortest
round-trip), so an integer counter is exact up to 2**53 (9.0e15: bytes counters reach it
after 9 PB) and rounded to the nearest representable float beyond.

Names a dcgm-exporter dashboard knows (``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``,
``DCGM_FI_DEV_PCIE_REPLAY_COUNTER``) are counters that do not end in ``_total``;
prometheus_client's text writer appends ``_total`` to the TYPE line of a counter family,
so those are exposed ``untyped`` under their exact names (:func:`dcgm_counter`) rather than
renamed. Every herd counter ends in ``_total`` and is typed ``counter``.
"""

from __future__ import annotations

import platform
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# 100 us .. 100 s, 1-2.5-5 per decade: 19 finite bounds (+Inf added at exposition).
LATENCY_BUCKETS: tuple[float, ...] = tuple(
    round(m * 10.0 ** e, 10) for e in range(-4, 2) for m in (1.0, 2.5, 5.0)) + (100.0,)


class LatencyHistogram:
    """Cumulative latency counts since the owner started: observed by one owner,
    read by collectors. ``observe`` is O(log buckets), no allocation."""

    __slots__ = ("bounds", "_counts", "sum", "count")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)   # the last one: over every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self._counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs, ``+Inf`` last (prometheus_client's bucket form)."""
        out: list[tuple[str, float]] = []
        acc = 0
        for b, c in zip(self.bounds, self._counts, strict=False):
            acc += c
            out.append((_le(b), float(acc)))
        out.append(("+Inf", float(self.count)))
        return out


def _le(b: float) -> str:
    return repr(float(b))


def gauge(name: str, help_: str, labels: Mapping[str, str], value: float) -> GaugeMetricFamily:
    """One gauge family with one sample."""
    m = GaugeMetricFamily(name, help_, labels=list(labels))
    m.add_metric(list(labels.values()), value)
    return m


def counter(name: str, help_: str, labels: Mapping[str, str], value: float) -> CounterMetricFamily:
    """One counter family (``name`` ends in ``_total``) with one sample."""
    m = CounterMetricFamily(name, help_, labels=list(labels))
    m.add_metric(list(labels.values()), value)
    return m


def family(kind: str, name: str, help_: str, rows: Iterable[tuple[Mapping[str, str], float]]) -> Metric:
    """A family of ``kind`` (gauge, counter, untyped) from ``(labels, value)`` rows; every
    row carries the same label names."""
    rows = list(rows)
    names = list(rows[0][0]) if rows else []
    m: GaugeMetricFamily | CounterMetricFamily | UnknownMetricFamily
    if kind == "gauge":
        m = GaugeMetricFamily(name, help_, labels=names)
    elif kind == "counter":
        m = CounterMetricFamily(name, help_, labels=names)
    elif kind == "untyped":
        m = UnknownMetricFamily(name, help_, labels=names)
    else:
        raise ValueError(f"unknown metric kind {kind!r}")
    for lb, v in rows:
        m.add_metric([lb[k] for k in names], float(v))
    return m


def dcgm_counter(name: str, help_: str, rows: Iterable[tuple[Mapping[str, str], float]]) -> Metric:
    """A dcgm-exporter counter under its exact name (untyped: see the module docstring)."""
    return family("untyped", name, f"{help_} (a counter; dcgm-exporter name, so untyped)", rows)


def histogram(name: str, help_: str,
              rows: Iterable[tuple[Mapping[str, str], LatencyHistogram]]) -> HistogramMetricFamily:
    rows = list(rows)
    names = list(rows[0][0]) if rows else []
    m = HistogramMetricFamily(name, help_, labels=names)
    for lb, h in rows:
        m.add_metric([lb[k] for k in names], h.cumulative(), h.sum)
    return m


def build_info(service: str, version: str, wire_version: int, labels: Mapping[str, str]) -> GaugeMetricFamily:
    """``herd_build_info{version,wire_version,python,service,...} 1``."""
    return gauge("herd_build_info", "The running herd build (always 1).",
                 {**labels, "service": service, "version": version, "wire_version": str(wire_version),
                  "python": platform.python_version()}, 1)


class FamiliesCollector(Collector):
    """A collector over a function that yields families at scrape time."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


def new_registry(*collectors: Collector, process: bool = True) -> CollectorRegistry:
    """A registry of this daemon's own (``process``: with ``process_*`` from /proc)."""
    reg = CollectorRegistry(auto_describe=False)
    for c in collectors:
        reg.register(c)
    if process:
        ProcessCollector(registry=reg)
    return reg


def exposition(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format (0.0.4) of ``registry``."""
    return generate_latest(registry)


def text_of(families: Iterable[Metric]) -> str:
    """Prometheus text of ``families`` alone (a throwaway registry, no process metrics)."""
    fams = list(families)
    return exposition(new_registry(FamiliesCollector(lambda: fams), process=False)).decode()

