"""`herd pki init|issue|bootstrap-token|status` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def herd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=str(ROOT), capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_pki_commands(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    r = herd("pki", "init", str(d), "--san", "placer.example", "--ca-days", "100", "--days", "50")
    assert r.returncode == 0, r.stderr
    assert "herd pki issue --node NODE_ID" in r.stdout
    assert stat.S_IMODE(os.stat(d / "ca.key").st_mode) == 0o600
    r = herd("pki", "init", str(d))
    assert r.returncode == 1 and "refusing to overwrite" in r.stderr and len(r.stderr.splitlines()) == 1
    r = herd("pki", "issue", str(d), "--node", "gpu-1", "--san", "10.1.2.3")
    assert r.returncode == 0, r.stderr
    assert (d / "nodes/gpu-1/node.crt").exists() and (d / "nodes/gpu-1/ca.crt").exists()
    assert stat.S_IMODE(os.stat(d / "nodes/gpu-1/node.key").st_mode) == 0o600
    r = herd("pki", "issue", str(d), "--role", "viewer")
    assert r.returncode == 0 and (d / "viewer.crt").exists()
    r = herd("pki", "issue", str(tmp_path / "nope"), "--node", "x")
    assert r.returncode == 1 and "no CA in" in r.stderr
    r = herd("pki", "bootstrap-token", str(d), "--ttl", "60", "--node", "gpu-2")
    assert r.returncode == 0 and r.stdout.startswith("hb1.")
    token = r.stdout.strip()
    assert token not in (d / "bootstrap-tokens.json").read_text()
    r = herd("pki", "bootstrap-token", str(d), "--ttl", "0", "--node", "gpu-3")
    assert r.returncode == 1 and "--ttl must be > 0" in r.stderr
    r = herd("pki", "status", str(d), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    subjects = [c["subject"] for c in st["certificates"]]
    assert set(subjects) == {"herd cluster CA", "placer", "operator", "viewer", "node:gpu-1"}
    days = {c["subject"]: c["days_left"] for c in st["certificates"]}
    assert 49 < days["placer"] <= 50 and 99 < days["herd cluster CA"] <= 100 and days["node:gpu-1"] <= 100
    assert subjects[0] != "herd cluster CA"   # soonest expiry first
    assert [(t["state"], t["node"]) for t in st["bootstrap_tokens"]] == [("unused", "gpu-2")]
    r = herd("pki", "status", str(d))
    assert r.returncode == 0 and "node:gpu-1" in r.stdout and "unused" in r.stdout
    r = herd("pki", "status")
    assert r.returncode == 1 and "give a PKI dir" in r.stderr
