"""Reading Prometheus text in tests: through ``prometheus_client.parser``, so a test checks
what a scraper sees (label order and float formatting are the library's business)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value of every sample in ``text``."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def types(text: str) -> dict[str, str]:
    """family name -> its TYPE (``counter`` families are named without ``_total``)."""
    return {fam.name: fam.type for fam in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample ``name`` whose labels include ``labels`` (None: absent)."""
    hits = [v for (n, lb), v in samples(text).items() if n == name and set(labels.items()) <= lb]
    assert len(hits) <= 1, f"{name}{labels}: {len(hits)} samples match"
    return hits[0] if hits else None
