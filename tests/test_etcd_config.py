"""The placer's etcd settings: absent by default (one placer, the file journal), read from
``[placer]`` in TOML, refused in one line when they cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from placer.config import PlacerConfig, load_config
from placer.errors import EtcdError, PlacerConfigError
from placer.etcd import tls_context


def test_defaults_keep_one_placer() -> None:
    cfg = load_config(None)
    assert cfg.etcd == [] and cfg.etcd_lease_ttl_s == 3 and cfg.etcd_prefix == "/herd/placer/"
    assert cfg == PlacerConfig()


def test_from_toml(tmp_path: Path) -> None:
    f = tmp_path / "placer.toml"
    f.write_text('[placer]\netcd = ["https://e1:2379", "https://e2:2379"]\netcd_lease_ttl_s = 2\n'
                 'etcd_ca = "/etc/herd/etcd/ca.crt"\netcd_cert = "/c"\netcd_key = "/k"\n')
    cfg = load_config(f)
    assert cfg.etcd == ["https://e1:2379", "https://e2:2379"] and cfg.etcd_lease_ttl_s == 2
    assert (cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key) == ("/etc/herd/etcd/ca.crt", "/c", "/k")


@pytest.mark.parametrize(("over", "msg"), [
    ({"etcd": ["e1:2379"]}, "bad etcd endpoint"),
    ({"etcd": ["http://"]}, "bad etcd endpoint"),
    ({"etcd_lease_ttl_s": 0}, "etcd_lease_ttl_s"),
    ({"etcd_lease_ttl_s": 2.5}, "bad placer config"),
    ({"etcd_prefix": "herd"}, "etcd_prefix"),
    ({"etcd_cert": "/c"}, "go together"),
])
def test_refused(over: dict[str, object], msg: str) -> None:
    with pytest.raises(PlacerConfigError, match=msg):
        load_config(None, **over)


def test_tls_context(tls_pki) -> None:  # noqa: ANN001 - infra.pki.ThrowawayPKI
    assert tls_context(None) is None
    f = tls_pki.files("placer")
    ctx = tls_context(str(f.ca), str(f.cert), str(f.key))
    assert ctx is not None and ctx.check_hostname
    with pytest.raises(EtcdError, match="etcd client TLS") as e:
        tls_context(str(tls_pki.dir / "missing.crt"))
    assert "\n" not in str(e.value)
