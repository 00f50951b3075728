"""gs:// credentials through ``google.auth.default()``, against loopback fakes of the external
services (real sockets): the GCE metadata server, an OAuth token endpoint (service-account
JWTs really signed and verified, authorized-user refresh tokens, STS token exchange for
workload identity federation), and a GCS JSON API that demands the bearer token (and answers
401 / 503 once)."""

from __future__ import annotations

import datetime
import json
import socket
from pathlib import Path
from urllib.parse import parse_qs

import pytest
import trio
from blake3 import blake3
from google.auth.compute_engine import _metadata

from infra.http import App, Request, Response, json_response, serve
from p2p.errors import OriginError, OriginUnavailable
from p2p.origins.gcs import GCSOrigin

MID = blake3(b"some manifest").hexdigest()
MDS_HEADERS = [("Metadata-Flavor", "Google")]


class FakeGoogle:
    def __init__(self, public_pem: bytes | None = None) -> None:
        self.public_pem = public_pem
        self.token_requests: list[str] = []
        self.seen_auth: list[str] = []
        self.seen_project: list[str] = []
        self.fail_once = {"401": True, "503": True}
        self.url = ""
        app = self.app = App()
        app.add("GET", "/", self.ping)
        app.add("GET", "/computeMetadata/v1/instance/service-accounts/{account}/", self.metadata_info)
        app.add("GET", "/computeMetadata/v1/instance/service-accounts/default/token", self.metadata_token)
        app.add("POST", "/token", self.oauth_token)
        app.add("POST", "/sts", self.sts_token)
        app.add("GET", "/storage/v1/b/{bucket}/o/{prefix}/{kind}/{name}", self.get_object)

    def _issue(self, source: str) -> Response:
        self.token_requests.append(source)
        return json_response({"access_token": f"tok-{source}-{len(self.token_requests)}", "expires_in": 3600,
                              "token_type": "Bearer"})

    async def ping(self, req: Request) -> Response:
        return Response(body=b"", content_type="text/plain", headers=MDS_HEADERS)

    async def metadata_info(self, req: Request) -> Response:
        body = json.dumps({"email": "vm@proj.iam.gserviceaccount.com", "scopes": ["x"], "aliases": ["default"]})
        return Response(body=body.encode(), headers=MDS_HEADERS)

    async def metadata_token(self, req: Request) -> Response:
        if req.headers.get("metadata-flavor") != "Google":
            return Response(status=403, body=b"missing Metadata-Flavor")
        r = self._issue("mds")
        r.headers = MDS_HEADERS
        return r

    async def oauth_token(self, req: Request) -> Response:
        form = parse_qs(req.body.decode())
        grant = form["grant_type"][0]
        if grant == "urn:ietf:params:oauth:grant-type:jwt-bearer":
            from google.auth import jwt

            claims = jwt.decode(form["assertion"][0], certs=self.public_pem,
                                audience="https://oauth2.googleapis.com/token")
            assert claims["iss"] == "herd@proj.iam.gserviceaccount.com"
            return self._issue("sa")
        if grant == "refresh_token":
            if form["refresh_token"] != ["refresh-me"] or form["client_id"] != ["cid"]:
                return json_response({"error": "invalid_grant", "error_description": "Bad Request"}, 400)
            return self._issue("user")
        return json_response({"error": "unsupported_grant_type"}, 400)

    async def sts_token(self, req: Request) -> Response:
        form = parse_qs(req.body.decode())
        assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:token-exchange"]
        assert form["subject_token"] == ["oidc-token-from-the-platform"]
        assert form["subject_token_type"] == ["urn:ietf:params:oauth:token-type:jwt"]
        self.token_requests.append("wif")
        return json_response({"access_token": f"tok-wif-{len(self.token_requests)}", "expires_in": 3600,
                              "token_type": "Bearer",
                              "issued_token_type": "urn:ietf:params:oauth:token-type:access_token"})

    async def get_object(self, req: Request) -> Response:
        auth = req.headers.get("authorization", "")
        self.seen_auth.append(auth)
        self.seen_project.append(req.headers.get("x-goog-user-project", ""))
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
            return Response(body=MID.encode() + b"\n", content_type="text/plain")
        return Response(status=404, body=b"")


@pytest.fixture
def no_ambient_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of this host's own credentials may leak in: no key file, an empty gcloud config
    dir, and no GCE check (NO_GCE_CHECK=true; google-auth reads it when imported)."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    (tmp_path / "gcloud").mkdir()
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setattr(_metadata, "_NO_GCE_CHECK", True)


def _origin(url: str) -> GCSOrigin:
    o = GCSOrigin("bkt", "pre", base_url=url, authenticate=True, retries=2)
    o.http.backoff_base = 0.01
    return o


async def _resolve(url: str) -> str:
    o = _origin(url)
    try:
        return await o.resolve("app:v1")
    finally:
        await o.aclose()


async def _with_fake(fake: FakeGoogle, body) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            fake.url = await nursery.start(serve, fake.app, "127.0.0.1:0")
            await body(fake.url)
            nursery.cancel_scope.cancel()


def _key_pair() -> tuple[str, bytes]:
    crypto = pytest.importorskip("cryptography.hazmat.primitives.asymmetric.rsa")
    from cryptography.hazmat.primitives import serialization

    key = crypto.generate_private_key(public_exponent=65537, key_size=2048)
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()).decode()
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    return private_pem, public_pem


async def test_metadata_server_token(no_ambient_credentials: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGoogle()
    monkeypatch.setattr(_metadata, "_NO_GCE_CHECK", False)

    async def body(url: str) -> None:
        host = url.removeprefix("http://")
        monkeypatch.setenv("GCE_METADATA_IP", host)                  # the ping (read per call)
        monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", host)   # GCE_METADATA_HOST, read at import
        assert await _resolve(url) == MID

    await _with_fake(fake, body)
    assert fake.token_requests == ["mds", "mds"]  # the 401 forced one refresh
    assert fake.seen_auth == ["Bearer tok-mds-1", "Bearer tok-mds-2", "Bearer tok-mds-2"]


async def test_service_account_key_file(no_ambient_credentials: None, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    private_pem, public_pem = _key_pair()
    fake = FakeGoogle(public_pem)

    async def body(url: str) -> None:
        keyfile = tmp_path / "sa.json"
        keyfile.write_text(json.dumps({
            "type": "service_account", "project_id": "proj", "private_key_id": "k1",
            "private_key": private_pem, "client_email": "herd@proj.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": f"{url}/token"}))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(keyfile))
        assert await _resolve(url) == MID

    await _with_fake(fake, body)
    assert fake.token_requests == ["sa", "sa"]


def _authorized_user(url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """An authorized_user file as gcloud writes it. google-auth always sends these to Google's
    token endpoint (it ignores a token_uri in the file): point that constant at the fake."""
    import google.oauth2.credentials

    monkeypatch.setattr(google.oauth2.credentials, "_GOOGLE_OAUTH2_TOKEN_ENDPOINT", f"{url}/token")
    return json.dumps({"type": "authorized_user", "client_id": "cid", "client_secret": "secret",
                       "refresh_token": "refresh-me", "token_uri": f"{url}/token",
                       "quota_project_id": "billing-proj"})


async def test_authorized_user_file(no_ambient_credentials: None, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What the issue saw fail ('missing fields client_email, token_uri'): an authorized_user
    file named by GOOGLE_APPLICATION_CREDENTIALS; its quota project goes along."""
    fake = FakeGoogle()

    async def body(url: str) -> None:
        (tmp_path / "user.json").write_text(_authorized_user(url, monkeypatch))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "user.json"))
        assert await _resolve(url) == MID

    await _with_fake(fake, body)
    assert fake.token_requests == ["user", "user"]
    assert fake.seen_project == ["billing-proj"] * 3


async def test_gcloud_application_default_file(no_ambient_credentials: None, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``gcloud auth application-default login`` writes this file; nothing else is set."""
    fake = FakeGoogle()

    async def body(url: str) -> None:
        (tmp_path / "gcloud" / "application_default_credentials.json").write_text(_authorized_user(url, monkeypatch))
        assert await _resolve(url) == MID

    await _with_fake(fake, body)
    assert fake.token_requests == ["user", "user"]


async def test_workload_identity_federation(no_ambient_credentials: None, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """An external_account configuration (what ``gcloud iam workload-identity-pools
    create-cred-config`` writes): the platform's OIDC token from a file, exchanged at STS."""
    fake = FakeGoogle()

    async def body(url: str) -> None:
        (tmp_path / "oidc").write_text("oidc-token-from-the-platform")
        (tmp_path / "wif.json").write_text(json.dumps({
            "type": "external_account",
            "audience": "//iam.googleapis.com/projects/123/locations/global/workloadIdentityPools/p/providers/x",
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
            "token_url": f"{url}/sts", "credential_source": {"file": str(tmp_path / "oidc")}}))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "wif.json"))
        assert await _resolve(url) == MID

    await _with_fake(fake, body)
    assert fake.token_requests[-2:] == ["wif", "wif"]  # the 401 forced a second exchange
    assert fake.seen_auth[-1].startswith("Bearer tok-wif-")


async def test_token_refreshed_before_it_expires(no_ambient_credentials: None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGoogle()
    fake.fail_once = {"401": False, "503": False}

    async def body(url: str) -> None:
        (tmp_path / "user.json").write_text(_authorized_user(url, monkeypatch))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "user.json"))
        o = _origin(url)
        try:
            await o.resolve("app:v1")
            await o.resolve("app:v1")
            assert o.auth is not None and o.auth.credentials is not None
            # two minutes left: inside google-auth's refresh margin, so it is renewed before use
            o.auth.credentials.expiry = (datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
                                         + datetime.timedelta(minutes=2))
            await o.resolve("app:v1")
        finally:
            await o.aclose()

    await _with_fake(fake, body)
    assert fake.token_requests == ["user", "user"]
    assert fake.seen_auth == ["Bearer tok-user-1", "Bearer tok-user-1", "Bearer tok-user-2"]


async def test_no_credentials_is_one_clear_error(no_ambient_credentials: None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with trio.fail_after(20):
        with pytest.raises(OriginError, match=r"^no GCS credentials: GOOGLE_APPLICATION_CREDENTIALS is not set"):
            await _resolve("http://127.0.0.1:9")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with trio.fail_after(20):
        with pytest.raises(OriginError, match=r"^cannot use GOOGLE_APPLICATION_CREDENTIALS=.*missing\.json"):
            await _resolve("http://127.0.0.1:9")


async def test_refused_refresh_token_is_one_line(no_ambient_credentials: None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGoogle()

    async def body(url: str) -> None:
        (tmp_path / "user.json").write_text(_authorized_user(url, monkeypatch).replace("refresh-me", "revoked"))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "user.json"))
        with pytest.raises(OriginError) as e:
            await _resolve(url)
        assert str(e.value).startswith("GCS token refresh failed (authorized-user credentials): ")
        assert "invalid_grant" in str(e.value) and "\n" not in str(e.value)
        assert not isinstance(e.value, OriginUnavailable)   # refused: an answer, not asked again

    await _with_fake(fake, body)


async def test_an_unreachable_token_endpoint_may_pass(no_ambient_credentials: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The token endpoint not answering is OriginUnavailable: the herd's retry layer asks again."""
    fake = FakeGoogle()

    async def body(url: str) -> None:
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))     # bound, never listening: connections refused
        try:
            (tmp_path / "user.json").write_text(
                _authorized_user(f"http://127.0.0.1:{dead.getsockname()[1]}", monkeypatch))
            monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "user.json"))
            with pytest.raises(OriginUnavailable, match=r"^GCS token refresh failed \(authorized-user"):
                await _resolve(url)
        finally:
            dead.close()

    await _with_fake(fake, body)
