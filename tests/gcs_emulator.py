"""Start the real ``gcp-storage-emulator`` process on a free loopback port (a test helper).

The emulator is single-threaded and rewrites its metadata on every write: keep what
tests put in it small.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _emulator_cmd() -> list[str] | None:
    exe = Path(sys.executable).parent / "gcp-storage-emulator"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("gcp-storage-emulator")
    return [found] if found else None


@contextlib.contextmanager
def gcs_emulator(workdir: Path, bucket: str = "herd-test", timeout: float = 20.0) -> Iterator[str]:
    """Run the emulator; yields its ``host:port`` (the STORAGE_EMULATOR_HOST value)."""
    cmd = _emulator_cmd()
    if cmd is None:
        pytest.skip("gcp-storage-emulator is not installed")
    port = _free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "emulator.log", "wb")
    proc = subprocess.Popen(
        [*cmd, "start", "--host", "127.0.0.1", "--port", str(port), "--default-bucket", bucket, "--in-memory", "-q"],
        cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    host = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gcp-storage-emulator exited: {(workdir / 'emulator.log').read_text()[-500:]}")
            try:
                r = httpx.get(f"http://{host}/storage/v1/b/{bucket}", timeout=1.0)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gcp-storage-emulator did not start in time")
            time.sleep(0.1)
        yield host
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        log.close()
