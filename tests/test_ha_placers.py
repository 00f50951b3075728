"""The placer-address set clients fail over with (scheduler_link.placers): pure, no I/O."""

from __future__ import annotations

import pytest

from infra.errors import ClientError
from scheduler_link.placers import Placers, leader_of, placer_urls, placer_urls_from_env, retry_after_s


def test_urls_split_commas_keep_order_and_drop_repeats() -> None:
    assert placer_urls(["http://a:1/, http://b:2", "http://a:1", "https://c:3"]) == \
        ["http://a:1", "http://b:2", "https://c:3"]
    assert placer_urls("http://a:1,,http://b:2/") == ["http://a:1", "http://b:2"]
    assert placer_urls(None) == []
    with pytest.raises(ClientError, match="must start with http"):
        placer_urls("a:1")


def test_urls_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERD_PLACER", "http://a:1,http://b:2")
    assert placer_urls_from_env(None) == ["http://a:1", "http://b:2"]
    assert placer_urls_from_env(["http://c:3"]) == ["http://c:3"]
    monkeypatch.delenv("HERD_PLACER")
    with pytest.raises(ClientError, match="no placer URL"):
        placer_urls_from_env(None)


def test_failed_moves_round_robin_only_from_the_current() -> None:
    p = Placers(["http://a", "http://b", "http://c"])
    assert p.current == "http://a"
    assert p.failed("http://a") == "http://b"
    assert p.failed("http://a") == "http://b"        # a late failure of an old request moves nothing
    assert p.failed("http://b/") == "http://c"
    assert p.failed("http://c") == "http://a" and p.switches == 3
    single = Placers(["http://a"])
    assert single.failed("http://a") == "http://a" and single.switches == 0


def test_learned_leader_becomes_current_and_is_kept() -> None:
    p = Placers(["http://a", "http://b"])
    assert p.learned("http://b/") == "http://b"
    assert p.learned("http://d") == "http://d" and p.urls == ["http://a", "http://b", "http://d"]
    assert p.failed("http://d") == "http://a"
    with pytest.raises(ValueError):
        Placers([])


def test_answers_naming_the_leader_or_asking_to_wait() -> None:
    assert leader_of(307, b'{"error": "not the leader", "leader": "http://b:7/"}') == "http://b:7"
    assert leader_of(307, b'{"leader": null}') is None
    assert leader_of(307, b"<html>") is None
    assert leader_of(307, b'{"leader": "ftp://x"}') is None
    assert leader_of(200, b'{"leader": "http://b:7"}') is None
    assert retry_after_s(503, "1") == 1.0
    assert retry_after_s(503, "600") == 5.0            # bounded
    assert retry_after_s(503, None) is None and retry_after_s(503, "soon") is None
    assert retry_after_s(500, "1") is None


def test_agent_config_takes_a_list_of_placers(tmp_path) -> None:  # noqa: ANN001
    from agent.config import load_config
    from agent.errors import ConfigError

    f = tmp_path / "agent.toml"
    f.write_text('[agent]\nplacer = ["http://p1:7470", "http://p2:7470"]\n')
    cfg = load_config(f)
    assert cfg.placer == "http://p1:7470" and cfg.placers == ("http://p1:7470", "http://p2:7470")
    cfg = load_config(None, {"placer": ["http://a:1", "http://b:2"]})      # --placer repeated
    assert cfg.placer == "http://a:1" and cfg.placers == ("http://a:1", "http://b:2")
    assert load_config(None, {"placer": "http://a:1"}).placers == ()
    f.write_text('[agent]\nplacer = ["http://p1:7470", "p2:7470"]\n')
    with pytest.raises(ConfigError, match="http"):
        load_config(f)


def test_a_failed_address_is_passed_over_for_a_while() -> None:
    p = Placers(["http://a", "http://b", "http://c"], hold_s=3.0)
    assert p.failed("http://a", now=10.0) == "http://b"
    # b (a follower) still names a, which failed a moment ago: b counts as failed, c is next
    assert p.learned("http://a", now=10.5) == "http://c"
    # c names a too: round robin passes over a (held) and comes to b
    assert p.learned("http://a", now=11.0) == "http://b"
    assert p.failed("http://b", now=11.1) == "http://c"
    # every other one held: the next anyway
    assert p.failed("http://c", now=11.2) == "http://a"
    # the hold over, a named leader is followed again
    assert p.learned("http://b", now=20.0) == "http://b"
    assert p.learned("http://a", now=20.0) == "http://a"


def test_not_leading_tells_a_follower_from_a_busy_leader() -> None:
    from infra.gate import BUSY_ANSWER
    from scheduler_link.placers import not_leading

    busy_body = BUSY_ANSWER.split(b"\r\n\r\n", 1)[1]
    assert not_leading(307, b'{"leader": "http://b:7"}')
    assert not_leading(503, b'{"error": "no leader", "leader": null}')
    assert not not_leading(503, busy_body)            # the connection gate: the leader, busy
    assert not not_leading(503, b"<html>") and not not_leading(500, b'{"leader": null}')


def test_a_redirect_names_the_leaders_framed_channel() -> None:
    from placer.ha import leader_of as leader_value
    from scheduler_link.placers import leader_wire_of

    assert leader_wire_of(307, b'{"leader": "http://b:7", "leader_wire": "tcp://b:8"}') == "tcp://b:8"
    assert leader_wire_of(307, b'{"leader": "http://b:7"}') is None
    assert leader_wire_of(307, b'{"leader": "http://b:7", "leader_wire": "http://x"}') is None
    assert leader_wire_of(503, b'{"leader_wire": "tcp://b:8"}') is None
    # the election value: the leader's URL and framed channel, or a plain URL
    assert leader_value('{"url": "http://a:1", "wire": "tcp://a:2"}') == ("http://a:1", "tcp://a:2")
    assert leader_value("http://a:1") == ("http://a:1", "")
    assert leader_value("{broken") == ("", "") and leader_value("") == ("", "")
