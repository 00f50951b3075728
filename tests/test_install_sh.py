"""systemd/install.sh run for real, as root, inside a private mount namespace: /etc, /opt,
/var/lib and /var/log are bind-mounted copies (so useradd, the units and the tokens land in
the test's directory, never on the host), ``systemctl`` is a stub that records its calls and
remembers which units are active, and the venv is pre-made with a stub ``pip`` (installing the
real package takes minutes; the script's own logic is what is tested here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "systemd" / "install.sh"

pytestmark = pytest.mark.root

STUB_SYSTEMCTL = """#!/bin/sh
# records each call; is-active answers from $STUB_STATE/active
echo "systemctl $*" >> "$STUB_STATE/calls"
cmd=$1; shift
case "$cmd" in
  is-active) [ "$1" = --quiet ] && shift; grep -qx "$1" "$STUB_STATE/active" 2>/dev/null; exit $? ;;
  start|restart) for u in "$@"; do grep -qx "$u" "$STUB_STATE/active" 2>/dev/null || echo "$u" >> "$STUB_STATE/active"; done ;;
  disable) if [ "$1" = --now ]; then shift; for u in "$@"; do grep -vx "$u" "$STUB_STATE/active" > "$STUB_STATE/a2" || true; mv "$STUB_STATE/a2" "$STUB_STATE/active"; done; fi ;;
  *) : ;;
esac
exit 0
"""


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (a private mount namespace, useradd)"
    for tool in ("unshare", "mount", "useradd"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, timeout=30)
    return None if r.returncode == 0 else "cannot create a mount namespace here"


class Host:
    """A fake host's file system and service manager, kept between runs of install.sh."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = root / "systemctl"
        self.state.mkdir()
        (self.state / "active").write_text("")
        subprocess.run(["cp", "-a", "/etc", str(root / "etc")], check=True, timeout=120)
        for d in ("opt", "varlib", "varlog", "bin"):
            (root / d).mkdir()
        stub = root / "bin" / "systemctl"
        stub.write_text(STUB_SYSTEMCTL)
        stub.chmod(0o755)

    def fake_venv(self, prefix: str) -> None:
        """Pre-make PREFIX/venv: pip records its arguments; python is this interpreter with the
        repository on its path (install.sh uses it to generate tokens)."""
        b = self.root / "opt" / prefix.removeprefix("/opt/") / "venv" / "bin"
        b.mkdir(parents=True, exist_ok=True)
        (b / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> {self.state}/calls\n')
        (b / "python").write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} "$@"\n')
        for f in ("pip", "python"):
            (b / f).chmod(0o755)

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        script = (
            "set -e\n"
            f"mount --bind {self.root}/etc /etc\n"
            f"mount --bind {self.root}/opt /opt\n"
            f"mount --bind {self.root}/varlib /var/lib\n"
            f"mount --bind {self.root}/varlog /var/log\n"
            f'export PATH={self.root}/bin:$PATH STUB_STATE={self.state}\n'
            f'exec sh {INSTALL} "$@"\n')
        (self.state / "calls").write_text("")
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "install.sh",
                               *args], capture_output=True, text=True, timeout=120)

    @property
    def calls(self) -> list[str]:
        return (self.state / "calls").read_text().splitlines()

    @property
    def active(self) -> set[str]:
        return set((self.state / "active").read_text().split())

    def etc(self, rel: str) -> Path:
        return self.root / "etc" / rel

    def units(self) -> set[str]:
        return {p.name for p in (self.root / "etc" / "systemd" / "system").glob("herd-*.service")}


@pytest.fixture
def host(tmp_path: Path) -> Host:
    why = _usable()
    if why:
        pytest.skip(why)
    return Host(tmp_path)


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_placer_only_with_prefix_then_upgrade_restarts_then_uninstall(host: Host) -> None:
    host.fake_venv("/opt/herd-x")
    out = _ok(host.run("--placer", "--prefix", "/opt/herd-x"))
    assert "enabled and started herd-placer.service" in out
    assert host.units() == {"herd-placer.service"}                      # --placer: no agent
    assert not host.etc("herd/agent.toml").exists() and host.etc("herd/placer.toml").exists()
    assert "herd-workload" not in host.etc("passwd").read_text()         # only the agent needs it
    unit = host.etc("systemd/system/herd-placer.service").read_text()
    assert "ExecStart=/opt/herd-x/venv/bin/herd placer run" in unit     # --prefix everywhere
    assert "Documentation=file:///opt/herd-x/share/doc/herd/README.md" in unit and "/opt/herd/" not in unit
    assert (host.root / "opt/herd-x/share/doc/herd/README.md").read_text() == (REPO / "README.md").read_text()
    tokens = sorted(p.name for p in host.etc("herd/tokens").iterdir())
    assert tokens == ["cluster.token", "metrics.token", "operator.token", "placer.token", "viewer.token"]
    assert oct(host.etc("herd/tokens").stat().st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in host.etc("herd/tokens").iterdir())
    assert host.active == {"herd-placer.service"}

    # an operator edit and the tokens survive a re-run; the running unit is restarted
    host.etc("herd/placer.toml").write_text(host.etc("herd/placer.toml").read_text() + "\n# edited\n")
    before = {p.name: p.read_text() for p in host.etc("herd/tokens").iterdir()}
    out = _ok(host.run("--prefix", "/opt/herd-x"))                       # no role: what is installed
    assert "upgraded and restarted herd-placer.service" in out
    assert "systemctl restart herd-placer.service" in host.calls
    assert any(c.startswith("pip install -q --force-reinstall --no-deps") for c in host.calls)
    assert host.etc("herd/placer.toml").read_text().endswith("# edited\n")
    assert {p.name: p.read_text() for p in host.etc("herd/tokens").iterdir()} == before
    assert host.units() == {"herd-placer.service"}

    # uninstall keeps configuration, tokens and state
    (host.root / "varlib/private/herd-placer").mkdir(parents=True)
    _ok(host.run("--uninstall", "--prefix", "/opt/herd-x"))
    assert host.units() == set() and host.active == set()
    assert "systemctl disable --now herd-placer.service" in host.calls
    assert not (host.root / "opt/herd-x").exists()
    assert host.etc("herd/placer.toml").exists() and host.etc("herd/tokens/placer.token").exists()
    assert (host.root / "varlib/private/herd-placer").exists()


def test_agent_and_placer_then_purge(host: Host) -> None:
    host.fake_venv("/opt/herd")
    out = _ok(host.run("--agent", "--placer", "--no-start"))
    assert host.units() == {"herd-agent.service", "herd-placer.service"}
    assert "not started: --no-start" in out and host.active == set()
    assert "herd-workload:" in host.etc("passwd").read_text()
    first = host.calls
    # idempotent: a second run makes the same calls and changes nothing on disk
    snapshot = {p: p.read_bytes() for p in (host.root / "etc/herd").rglob("*") if p.is_file()}
    units = {u: host.etc(f"systemd/system/{u}").read_text() for u in host.units()}
    _ok(host.run("--agent", "--placer", "--no-start"))
    assert host.calls == first
    assert {p: p.read_bytes() for p in (host.root / "etc/herd").rglob("*") if p.is_file()} == snapshot
    assert {u: host.etc(f"systemd/system/{u}").read_text() for u in host.units()} == units
    assert host.etc("passwd").read_text().count("herd-workload:") == 1

    # uninstalling one role leaves the other and the shared files
    _ok(host.run("--uninstall", "--placer", "--purge"))
    assert host.units() == {"herd-agent.service"}
    assert not host.etc("herd/placer.toml").exists() and host.etc("herd/tokens/cluster.token").exists()
    assert (host.root / "opt/herd/venv").exists()
    (host.root / "varlib/herd").mkdir()
    _ok(host.run("--uninstall", "--purge"))
    assert host.units() == set() and not host.etc("herd").exists() and not (host.root / "varlib/herd").exists()
    assert "herd-workload:" not in host.etc("passwd").read_text()
    assert not (host.root / "opt/herd").exists()


def test_default_is_the_agent_and_tokens_can_be_copied(host: Host, tmp_path: Path) -> None:
    host.fake_venv("/opt/herd")
    src = tmp_path / "set"
    src.mkdir()
    for role in ("placer", "cluster", "operator"):
        (src / f"{role}.token").write_text(f"{role}-secret\n")
    r = host.run("--tokens", str(src))
    _ok(r)
    assert host.units() == {"herd-agent.service"} and host.active == {"herd-agent.service"}
    assert host.etc("herd/tokens/cluster.token").read_text() == "cluster-secret\n"
    assert "has no viewer.token" in r.stderr
    r = host.run("--purge")
    assert r.returncode == 2 and "--purge goes with --uninstall" in r.stderr
    r = host.run("--prefix", "relative")
    assert r.returncode == 2 and "absolute" in r.stderr


def test_tls_material_made_once_or_copied(host: Host, tmp_path: Path) -> None:
    """A placer install makes the cluster CA once (kept on upgrade) and installs its certificate;
    an agent install copies a node's `herd pki issue` dir; keys are 0600 in 0700 dirs."""
    import stat

    from infra import pki
    host.fake_venv("/opt/herd")
    _ok(host.run("--placer", "--no-start"))
    ca_key = host.etc("herd/pki/ca.key")
    assert stat.S_IMODE(ca_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(host.etc("herd/tls").stat().st_mode) == 0o700
    assert stat.S_IMODE(host.etc("herd/tls/placer.key").stat().st_mode) == 0o600
    assert host.etc("herd/tls/ca.crt").read_bytes() == host.etc("herd/pki/ca.crt").read_bytes()
    first = ca_key.read_bytes()
    _ok(host.run("--placer", "--no-start"))
    assert ca_key.read_bytes() == first           # never a second CA
    unit = host.etc("systemd/system/herd-placer.service").read_text()
    assert "LoadCredential=placer.key:/etc/herd/tls/placer.key" in unit and "HERD_TLS_DIR=%d" in unit

    d = tmp_path / "pki"
    pki.init(d)
    node_dir = pki.issue_node(d, "gpu-7")
    r = host.run("--agent", "--no-start", "--tls", str(node_dir))
    _ok(r)
    assert host.etc("herd/tls/node.crt").read_bytes() == (node_dir / "node.crt").read_bytes()
    assert stat.S_IMODE(host.etc("herd/tls/node.key").stat().st_mode) == 0o600
    r = host.run("--agent", "--no-start", "--tls", str(tmp_path / "nothing"))
    assert r.returncode == 1 and "missing" in r.stderr and "ca.crt" in r.stderr
