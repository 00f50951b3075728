"""Agent config (TOML + flags, strict) and sd_notify outside/inside systemd."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import trio

from agent.config import load_config
from agent.errors import ConfigError
from agent.sdnotify import Notifier

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_file_and_overrides(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text('[agent]\nnode_id = "n7"\ngpus = "simulated:dgx-h100"\nheartbeat_s = 2\n'
                 '[topology]\nzone = "z1"\n[workloads]\nshim_pool = 4\n')
    cfg = load_config(f, {"listen": "127.0.0.1:0", "rack": "r9", "node_id": None})
    assert (cfg.node_id, cfg.gpus, cfg.heartbeat_s, cfg.listen) == ("n7", "simulated:dgx-h100", 2.0, "127.0.0.1:0")
    assert (cfg.topology.zone, cfg.topology.block, cfg.topology.rack) == ("z1", "block-a", "r9")
    assert cfg.workloads.shim_pool == 4
    assert str(cfg.store_dir).endswith("/store")
    assert load_config(None).gpus == "nvml"


@pytest.mark.parametrize("text,msg", [
    ('[agent]\nnode_idd = "x"\n', "unknown key [agent] node_idd"),
    ('[agnet]\n', "unknown section [agnet]"),
    ('[agent]\nheartbeat_s = "5"\n', "wrong type"),
    ('[agent]\nopen_reads = 1\n', "wrong type"),
    ('[workloads]\nshim_pool = true\n', "must be a number"),
    ('[agent]\ngpus = "cuda"\n', "gpus must be"),
    ('[agent]\nlisten = "localhost"\n', "listen must be HOST:PORT"),
    ('[agent]\nplacer = "placer:7470"\n', "http(s) URL"),
    ('[workloads]\nlog_max_bytes = 10\n', "log_max_bytes"),
    ('[agent\n', "not valid TOML"),
])
def test_bad_config_is_a_clear_error(tmp_path, text, msg):
    f = tmp_path / "a.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert msg in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


async def test_sd_notify_outside_and_inside_systemd(tmp_path):
    off = Notifier({})
    assert not off.enabled and off.ready() is False and off.stopping() is False
    with trio.fail_after(5):
        await off.watchdog()  # returns at once when no watchdog is asked for
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        s.settimeout(5)
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
        assert n.watchdog_s is None  # WATCHDOG_PID names another process
        assert n.ready("3 GPUs\nok") and n.status("a\nb")
        assert s.recv(100) == b"READY=1\nSTATUS=3 GPUs ok"  # one line per field
        assert s.recv(100) == b"STATUS=a b"


async def test_agent_start_failures_are_one_line(tmp_path):
    busy = trio.socket.socket()
    await busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with trio.fail_after(60):
            for extra, msg in ((["--listen", f"127.0.0.1:{port}"], f"Address already in use (listen 127.0.0.1:{port}"),
                               (["--gpus", "simulated:nope"], "unknown simulated profile"),
                               (["--listen", "nowhere"], "listen must be HOST:PORT")):
                r = await trio.run_process(
                    [sys.executable, "-m", "cli.main", "agent", "run", "--gpus", "simulated:dgx-h100", "--state-dir",
                     str(tmp_path / "s"), "--listen", "127.0.0.1:0", "--no-data-plane", *extra],
                    cwd=str(ROOT), capture_stdout=True, capture_stderr=True, check=False)
                err = r.stderr.decode()
                assert r.returncode == 1 and msg in err and len(err.strip().splitlines()) == 1, err
    finally:
        busy.close()
