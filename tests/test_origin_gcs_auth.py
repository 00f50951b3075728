"""gs:// credentials against loopback fakes of the external services: the GCE metadata
server, a service-account token endpoint (the JWT is really signed and verified), and a
GCS JSON API that demands the bearer token (and answers 401 / 503 once)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import parse_qs

import pytest
import trio
from blake3 import blake3

from p2p.errors import OriginError
from p2p.origins.gcs import GCSOrigin
from scheduler_link.http import App, Request, Response, json_response, serve

MID = blake3(b"some manifest").hexdigest()


class FakeGoogle:
    def __init__(self, public_pem: bytes | None = None) -> None:
        self.public_pem = public_pem
        self.token_requests: list[str] = []
        self.seen_auth: list[str] = []
        self.fail_once = {"401": True, "503": True}
        self.url = ""
        app = self.app = App()
        app.add("GET", "/computeMetadata/v1/instance/service-accounts/default/token", self.metadata_token)
        app.add("POST", "/token", self.sa_token)
        app.add("GET", "/storage/v1/b/{bucket}/o/{prefix}/{kind}/{name}", self.get_object)

    async def metadata_token(self, req: Request) -> Response:
        if req.headers.get("metadata-flavor") != "Google":
            return Response(status=403, body=b"missing Metadata-Flavor")
        self.token_requests.append("metadata")
        return json_response({"access_token": f"tok-mds-{len(self.token_requests)}", "expires_in": 3600,
                              "token_type": "Bearer"})

    async def sa_token(self, req: Request) -> Response:
        from google.auth import jwt

        form = parse_qs(req.body.decode())
        assertion = form["assertion"][0]
        assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
        claims = jwt.decode(assertion, certs=self.public_pem, audience="https://oauth2.googleapis.com/token")
        assert claims["iss"] == "herd@proj.iam.gserviceaccount.com"
        self.token_requests.append("service-account")
        return json_response({"access_token": f"tok-sa-{len(self.token_requests)}", "expires_in": 3600,
                              "token_type": "Bearer"})

    async def get_object(self, req: Request) -> Response:
        auth = req.headers.get("authorization", "")
        self.seen_auth.append(auth)
        if not auth.startswith("Bearer tok-"):
            return Response(status=401, body=b"")
        if self.fail_once["401"]:  # the token "expired": the client must refresh and retry
            self.fail_once["401"] = False
            return Response(status=401, body=b"")
        if self.fail_once["503"]:
            self.fail_once["503"] = False
            return Response(status=503, body=b"")
        p = req.params
        if (p["bucket"], p["prefix"], p["kind"], p["name"]) == ("bkt", "pre", "refs", "app:v1"):
            return Response(body=MID.encode() + b"\n", content_type="application/octet-stream")
        return Response(status=404, body=b"")


async def _resolve(url: str) -> str:
    o = GCSOrigin("bkt", "pre", base_url=url, authenticate=True, retries=2)
    o.http.backoff_base = 0.01
    try:
        return await o.resolve("app:v1")
    finally:
        await o.aclose()


async def test_metadata_server_token(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGoogle()
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake.url = url = await nursery.start(serve, fake.app, "127.0.0.1:0")
            monkeypatch.setenv("GCE_METADATA_HOST", url.removeprefix("http://"))
            assert await _resolve(url) == MID
            nursery.cancel_scope.cancel()
    assert fake.token_requests == ["metadata", "metadata"]  # the 401 forced one refresh
    assert fake.seen_auth == ["Bearer tok-mds-1", "Bearer tok-mds-2", "Bearer tok-mds-2"]


async def test_service_account_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    crypto = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.rsa")
    from cryptography.hazmat.primitives import serialization

    key = crypto.generate_private_key(public_exponent=65537, key_size=2048)
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    fake = FakeGoogle(public_pem)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake.url = url = await nursery.start(serve, fake.app, "127.0.0.1:0")
            keyfile = tmp_path / "sa.json"
            keyfile.write_text(json.dumps({
                "type": "service_account", "project_id": "proj", "private_key_id": "k1",
                "private_key": private_pem, "client_email": "herd@proj.iam.gserviceaccount.com",
                "client_id": "1", "token_uri": f"{url}/token"}))
            monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(keyfile))
            monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # must not be used
            assert await _resolve(url) == MID
            nursery.cancel_scope.cancel()
    assert fake.token_requests == ["service-account", "service-account"]


async def test_no_credentials_is_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # nothing listens on the discard port
    with trio.fail_after(20):
        with pytest.raises(OriginError, match="metadata server .* is unreachable"):
            await _resolve("http://127.0.0.1:9")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with trio.fail_after(20):
        with pytest.raises(OriginError, match="service-account key"):
            await _resolve("http://127.0.0.1:9")
