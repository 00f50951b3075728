"""Start the real ``gcp-storage-emulator`` process on a free loopback port (a test helper).

The emulator is single-threaded and rewrites its metadata on every write: keep what
tests put in it small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2p.origins.emulator import emulator_available, start_emulator


@contextlib.contextmanager
def gcs_emulator(workdir: Path, bucket: str = "herd-test", timeout: float = 20.0) -> Iterator[str]:
    """Run the emulator; yields its ``host:port`` (the STORAGE_EMULATOR_HOST value)."""
    if not emulator_available():
        pytest.skip("gcp-storage-emulator is not installed")
    emu = start_emulator(workdir, bucket=bucket, timeout=timeout)
    try:
        yield emu.host
    finally:
        emu.stop()
