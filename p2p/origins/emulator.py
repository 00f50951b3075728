"""Run the real ``gcp-storage-emulator`` as a local GCS (the demo and the tests use it).

It is single-threaded and rewrites its metadata on every write: keep what goes into
it small. ``STORAGE_EMULATOR_HOST`` set to :attr:`Emulator.host` points the gs://
origin at it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..errors import OriginError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def emulator_command() -> list[str] | None:
    exe = Path(sys.executable).parent / "gcp-storage-emulator"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("gcp-storage-emulator")
    return [found] if found else None


def emulator_available() -> bool:
    return emulator_command() is not None


@dataclass
class Emulator:
    host: str                      # host:port, the STORAGE_EMULATOR_HOST value
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def start_emulator(workdir: Path, bucket: str = "herd", timeout: float = 20.0) -> Emulator:
    """Start the emulator on a free loopback port with ``bucket`` created; wait until it answers."""
    cmd = emulator_command()
    if cmd is None:
        raise OriginError("gcp-storage-emulator is not installed")
    port = _free_port()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "emulator.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*cmd, "start", "--host", "127.0.0.1", "--port", str(port), "--default-bucket", bucket,
             "--in-memory", "-q"],
            cwd=workdir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONWARNINGS": "ignore"}, start_new_session=True)
    emu = Emulator(f"127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise OriginError(f"gcp-storage-emulator exited: {log_path.read_text()[-500:]}")
            try:
                if httpx.get(f"http://{emu.host}/storage/v1/b/{bucket}", timeout=1.0).status_code == 200:
                    return emu
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise OriginError(f"gcp-storage-emulator did not answer within {timeout:.0f}s")
            time.sleep(0.1)
    except BaseException:
        emu.stop()
        raise
