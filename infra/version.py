"""This package's version, looked up once for every daemon and the CLI (``/healthz``,
``herd_build_info``, ``herd version``)."""

from __future__ import annotations

import importlib.metadata


def package_version(default: str = "unknown") -> str:
    try:
        return importlib.metadata.version("herd")
    except importlib.metadata.PackageNotFoundError:
        return default


PACKAGE_VERSION = package_version()
