"""Agent config (TOML + flags, strict) and sd_notify outside/inside systemd."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import trio

from agent.config import RelayConfig, keys, load_config, replace, sections
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
    ('[agent]\nnode_idd = "x"\n', "unknown key [agent] node_idd (known: allowed_origins, data_listen,"),
    ('[agnet]\n', "unknown section [agnet] (known: agent, topology, store, workloads, relay"),
    ('[workloads]\nshim_poool = 2\n', "unknown key [workloads] shim_poool (known: allow_root,"),
    ('[topology]\nzon = "z"\n', "unknown key [topology] zon (known: block, rack, zone)"),
    ('[relay]\nenable = true\n', "unknown key [relay] enable (known: advertise, enabled, hold_s, listen, trust_intervals)"),
    ('[agent]\ntopology = { zone = "z" }\n', "[topology] is a section"),
    ('store = 1\n', "[store] must be a table"),
    ('[agent]\nheartbeat_s = "5"\n', "[agent] heartbeat_s has the wrong type: expected `float`, got `str`"),
    ('[agent]\nopen_reads = 1\n', "[agent] open_reads has the wrong type: expected `bool`, got `int`"),
    ('[workloads]\nshim_pool = true\n', "[workloads] shim_pool has the wrong type: expected `int`, got `bool`"),
    ('[agent]\nallowed_origins = ["gs://b", 3]\n', "[agent] allowed_origins[1] has the wrong type"),
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
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_every_typed_key_is_a_file_key_and_overrides_are_checked(tmp_path):
    """The Structs are the schema: a field of a section type is a key of that section (no list to keep)."""
    f = tmp_path / "a.toml"
    f.write_text('[workloads]\nblob_timeout_s = 3\n[store]\nquota_bytes = 4096\n[relay]\nadvertise = "10.0.0.5:8472"\n')
    cfg = load_config(f, {"relay_enabled": True, "relay_listen": "127.0.0.1:9", "zone": "z2"})
    assert cfg.workloads.blob_timeout_s == 3.0 and isinstance(cfg.workloads.blob_timeout_s, float)
    assert (cfg.store.quota_bytes, cfg.relay) == (4096, RelayConfig(enabled=True, listen="127.0.0.1:9",
                                                                    advertise="10.0.0.5:8472"))
    assert cfg.topology.zone == "z2"
    assert set(sections()) == {"topology", "store", "workloads", "relay"} | set(sections())  # others may add more
    assert "heartbeat_s" in keys() and "topology" not in keys()
    with pytest.raises(ConfigError, match="unknown override relay_enable$"):
        load_config(None, {"relay_enable": True})
    with pytest.raises(ConfigError, match=r"\[agent\] heartbeat_s has the wrong type"):
        load_config(None, {"heartbeat_s": "fast"})
    assert replace(cfg, data_listen=None).data_listen is None and cfg.data_listen == "127.0.0.1:0"


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"^cannot read config file .*: Is a directory$"):
        load_config(tmp_path)
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[agent]")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "bin.toml")


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
                # HERD_INSECURE=1 (conftest) is warned once, on its own line, where the agent got that far
                lines = [ln for ln in r.stderr.decode().strip().splitlines() if "is INSECURE" not in ln]
                err = "\n".join(lines)
                assert r.returncode == 1 and msg in err and len(lines) == 1, err
    finally:
        busy.close()
