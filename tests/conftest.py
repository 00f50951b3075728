"""Shared fixtures. Tests never hit the internet; sockets are loopback only."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The existing fixtures run placers and agents plain (insecure = true by the environment,
# which subprocesses inherit; each daemon logs its warning). Tests of TLS set up a throwaway
# CA (``tls_pki`` below, infra.pki.throwaway) and say ``insecure = false`` explicitly.
os.environ.setdefault("HERD_INSECURE", "1")


@pytest.fixture
def token_dir(tmp_path: Path) -> Path:
    from infra.auth import generate_token_dir
    return generate_token_dir(tmp_path / "tokens")


@pytest.fixture
def tls_pki(tmp_path: Path):  # -> infra.pki.ThrowawayPKI
    """A throwaway cluster CA with placer and operator certificates (nodes on demand)."""
    from infra.pki import throwaway
    return throwaway(tmp_path / "pki")


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """As root, put this session's temp dirs outside /tmp/pytest-of-root: any pytest
    session started meanwhile chmods that dir back to 0700, which would cut the workload
    user (see below) off from every test's state dir."""
    if is_root() and not config.option.basetemp:
        config.option.basetemp = f"/tmp/herd-pytest-root-{os.getpid()}"
        config._herd_basetemp = config.option.basetemp  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    base = getattr(config, "_herd_basetemp", None)
    if base:
        import shutil
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(autouse=True)
def _workload_user_can_reach_tmp(request: pytest.FixtureRequest) -> None:
    """As root, agents run workloads as an unprivileged user (agent.isolation): that user
    must be able to traverse into the test's state dirs. pytest makes its temp dirs 0700;
    open them to traversal (not listing) for the test."""
    if not is_root() or "tmp_path" not in request.fixturenames:
        return
    tmp = request.getfixturevalue("tmp_path")
    base = Path(request.config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
    # every dir from the test's up to this session's temp root (under pytest-xdist a worker's
    # base is the root's popen-gwN, and the controller made the root 0700)
    root = base.parent if base.name.startswith("popen-gw") else base
    for d in (tmp, *tmp.parents):
        if d != root and root not in d.parents:
            break
        os.chmod(d, 0o711)


@pytest.fixture(autouse=True)
def _virtual_time_fsyncs_inline(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under trio's autojump clock a worker thread is invisible: while the placer journal's
    fsync runs in one, the clock jumps from deadline to deadline and a slow disk turns into
    virtual-time HTTP timeouts. Virtual-time tests fsync on the event loop instead (the same
    real fsync; the loop just waits for it). So do the placer's fleet snapshot and inventories."""
    if "autojump_clock" not in request.fixturenames:
        return
    from placer import fleetsnap, inventories
    from placer.journal import Journal
    monkeypatch.setattr(Journal, "sync_in_thread", False)
    monkeypatch.setattr(fleetsnap, "WRITE_IN_THREAD", False)
    monkeypatch.setattr(inventories, "WRITE_IN_THREAD", False)


@pytest.fixture
def etcd_cluster(tmp_path):
    """A one-member etcd of this test's own (skipped where ``etcd`` is absent: testing.etcd)."""
    from testing.etcd import etcd_running
    yield from etcd_running(tmp_path / "etcd", 1)
