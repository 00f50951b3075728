"""Insecure is a warning however it was asked (issue 17): ``HERD_INSECURE=1`` in the
environment -- which a shell or a unit file can carry into a daemon unnoticed -- is
logged at WARNING once per daemon, naming the daemon and the switch, like a config's
``insecure = true``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent import certs
from agent.config import AgentConfig
from infra.tls import daemon_security


def _insecure_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "herd.link.tls" and "is INSECURE" in r.getMessage()]


def test_herd_insecure_in_the_environment_is_one_warning_naming_the_daemon(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HERD_INSECURE", "1")
    caplog.set_level(logging.DEBUG, logger="herd.link.tls")
    sec = daemon_security(None, "placer", insecure=None, what="placer")
    assert sec.insecure
    (rec,) = _insecure_records(caplog)
    assert rec.levelno == logging.WARNING
    msg = rec.getMessage()
    assert msg.startswith("placer is INSECURE: plain HTTP/TCP") and "HERD_INSECURE=1 in the environment" in msg


def test_an_agent_with_herd_insecure_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HERD_INSECURE", "1")
    caplog.set_level(logging.DEBUG, logger="herd.link.tls")
    sec = certs.security_for(AgentConfig(node_id="n7", gpus="simulated:dgx-h100", state_dir=str(tmp_path)))
    assert sec is not None and sec.insecure
    (rec,) = _insecure_records(caplog)
    assert rec.levelno == logging.WARNING and rec.getMessage().startswith("agent n7 is INSECURE")


def test_insecure_true_in_a_config_is_a_warning_too(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("HERD_INSECURE", raising=False)
    caplog.set_level(logging.DEBUG, logger="herd.link.tls")
    daemon_security(None, "placer", insecure=True, what="placer")
    (rec,) = _insecure_records(caplog)
    assert rec.levelno == logging.WARNING and "(insecure = true;" in rec.getMessage()
