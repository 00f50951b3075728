"""`herd artifact ...` as a real subprocess: --json outputs and the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from blake3 import blake3

from tests.conftest import is_root

ROOT = Path(__file__).resolve().parent.parent
_SCRIPT = Path(sys.executable).parent / "herd"
HERD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "cli.main"]

PUBLISH_KEYS = {"manifest", "name", "files", "bytes", "chunks", "chunks_uploaded", "bytes_uploaded", "seconds",
                "dedup_refs", "chunks_known", "chunks_checked"}
FETCH_KEYS = {"manifest", "bytes", "bytes_from_origin", "bytes_from_peers", "bytes_local", "chunks_fetched",
              "seconds"}


def herd(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*HERD, *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env={**os.environ, "HERD_ORIGIN": ""})
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def herd_json(*args: str) -> dict:
    r = herd(*args, "--json")
    assert r.stderr == ""  # no progress bars when stderr is not a terminal
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    return json.loads(lines[0])


def one_line_error(r: subprocess.CompletedProcess[str], needle: str) -> None:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("herd: error: ") and needle in lines[0], lines[0]


@pytest.fixture
def published(tmp_path: Path) -> tuple[Path, str, dict, dict]:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "model.bin").write_bytes(os.urandom(900_000))
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    origin = f"file://{tmp_path}/origin"
    v1 = herd_json("artifact", "publish", str(src), "--origin", origin, "--name", "app:v1", "--avg-chunk", "64k")
    (src / "new.txt").write_text("added in v2\n")
    (src / "run.sh").unlink()
    v2 = herd_json("artifact", "publish", str(src), "--origin", origin, "--name", "app:v2", "--avg-chunk", "64k")
    return tmp_path, origin, v1, v2


def test_publish_fetch_show_diff_verify_json(published: tuple[Path, str, dict, dict]) -> None:
    tmp_path, origin, v1, v2 = published
    assert set(v1) == PUBLISH_KEYS and v1["name"] == "app:v1" and v1["files"] == 2
    assert v1["chunks_uploaded"] == v1["chunks"] > 1
    assert v2["chunks_uploaded"] == 1  # only new.txt's chunk is new
    store, into = tmp_path / "store", tmp_path / "current"
    f1 = herd_json("artifact", "fetch", "app:v1", "--origin", origin, "--store", str(store), "--into", str(into))
    assert set(f1) == FETCH_KEYS and f1["manifest"] == v1["manifest"] and f1["bytes_from_origin"] == f1["bytes"]
    assert (into / "d" / "model.bin").read_bytes() == (tmp_path / "src" / "d" / "model.bin").read_bytes()
    assert os.access(into / "run.sh", os.X_OK)
    f2 = herd_json("artifact", "fetch", v2["manifest"], "--origin", origin, "--store", str(store),
                   "--into", str(into))
    assert f2["chunks_fetched"] == 1 and f2["bytes_local"] == f2["bytes"] - f2["bytes_from_origin"]
    assert (into / "new.txt").read_text() == "added in v2\n" and not (into / "run.sh").exists()
    show = herd_json("artifact", "show", "app:v2", "--origin", origin)
    assert show["manifest"] == v2["manifest"] and show["files"] == 2
    assert [e["path"] for e in show["entries"]] == ["d", "d/model.bin", "new.txt"]
    d = herd_json("artifact", "diff", "app:v1", "app:v2", "--origin", origin)
    assert (d["added"], d["removed"], d["changed"]) == (["new.txt"], ["run.sh"], [])
    assert d["bytes_new"] == len("added in v2\n")
    ver = herd_json("artifact", "verify", "--store", str(store))
    assert ver["ok"] and ver["chunks_checked"] == v1["chunks"] + 1 and ver["bad_chunks"] == []
    # Human output works too.
    assert "published" not in herd("artifact", "show", "app:v1", "--origin", origin).stderr
    # A rotten chunk in the store: verify drops it, says so on one line, exits non-zero.
    victim = next(p for p in (store / "chunks").rglob("*") if p.is_file())
    os.chmod(victim, 0o644)
    victim.write_bytes(b"rot")
    r = herd("artifact", "verify", "--store", str(store), "--json", ok=False)
    one_line_error(r, "1 bad chunks")
    assert json.loads(r.stdout)["bad_chunks"] == [victim.name]


def test_one_line_errors(published: tuple[Path, str, dict, dict]) -> None:
    tmp_path, origin, v1, _ = published
    store = str(tmp_path / "store")
    one_line_error(herd("artifact", "fetch", "app:nope", "--origin", origin, "--store", store,
                        "--into", str(tmp_path / "x"), ok=False), "unknown ref 'app:nope'")
    one_line_error(herd("artifact", "show", "app:v1", "--origin", f"file://{tmp_path}/nowhere", ok=False),
                   "unreachable")
    one_line_error(herd("artifact", "show", "app:v1", "--origin", "http://127.0.0.1:9/x", "--retries", "0",
                        ok=False), "unreachable")
    one_line_error(herd("artifact", "publish", str(tmp_path / "src"), "--origin", origin, "--name", "../evil",
                        ok=False), "invalid ref name")
    one_line_error(herd("artifact", "publish", str(tmp_path / "nodir"), "--origin", origin, "--name", "a",
                        ok=False), "not a directory")
    one_line_error(herd("artifact", "show", "app:v1", ok=False), "--origin")
    one_line_error(herd("artifact", "show", "app:v1", "--origin", "http://[::1", ok=False), "invalid origin URL")
    one_line_error(herd("artifact", "publish", str(tmp_path / "src"), "--origin", "http://127.0.0.1:9/x",
                        "--name", "a", ok=False), "read-only")
    one_line_error(herd("artifact", "publish", str(tmp_path / "src"), "--origin", origin, "--name", "a",
                        "--avg-chunk", "0", ok=False), "avg_size")
    (tmp_path / "afile").write_text("")
    one_line_error(herd("artifact", "fetch", "app:v1", "--origin", origin, "--store", str(tmp_path / "afile"),
                        "--into", str(tmp_path / "x"), ok=False), "cannot open store")
    one_line_error(herd("artifact", "fetch", "app:v1", "--origin", origin, "--store", store, "--quota", "lots",
                        "--into", str(tmp_path / "x"), ok=False), "--quota")
    one_line_error(herd("artifact", "fetch", "app:v1", "--origin", origin, "--store", str(tmp_path / "small"),
                        "--quota", "100k", "--into", str(tmp_path / "x"), ok=False), "quota")
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    one_line_error(herd("artifact", "fetch", "app:v1", "--origin", origin, "--store", store,
                        "--into", str(tmp_path / "full"), ok=False), "non-empty directory")
    # A hostile manifest (its bytes hash to its id, but it is not a valid manifest).
    junk = b"\x95\x01\x94\xa4../x"
    jid = blake3(junk).hexdigest()
    (tmp_path / "origin" / "manifests" / jid).write_bytes(junk)
    one_line_error(herd("artifact", "fetch", jid, "--origin", origin, "--store", store,
                        "--into", str(tmp_path / "h"), ok=False), "manifest")
    assert not (tmp_path / "h").exists()
    # Hash mismatch: a corrupted chunk at the origin; nothing half-written is visible.
    chunks = sorted((tmp_path / "origin" / "chunks").iterdir())
    for c in chunks:
        c.write_bytes(b"\x00" * c.stat().st_size)
    r = herd("artifact", "fetch", "app:v1", "--origin", origin, "--store", str(tmp_path / "s2"),
             "--into", str(tmp_path / "y"), ok=False)
    one_line_error(r, "does not match its hash")
    assert not (tmp_path / "y").exists()
    assert os.listdir(tmp_path / "s2" / "artifacts") == []


def test_full_disk_one_line(published: tuple[Path, str, dict, dict]) -> None:
    tmp_path, origin, _, _ = published
    if not is_root():
        pytest.skip("needs root for mount -t tmpfs")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)],
                      capture_output=True, timeout=10).returncode != 0:
        pytest.skip("mount -t tmpfs refused")
    try:
        r = herd("artifact", "fetch", "app:v1", "--origin", origin, "--store", str(mnt / "store"),
                 "--into", str(tmp_path / "z"), ok=False)
        one_line_error(r, "disk full")
        assert not (tmp_path / "z").exists()
        assert os.listdir(mnt / "store" / "tmp") == []
        assert os.listdir(mnt / "store" / "artifacts") == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)
