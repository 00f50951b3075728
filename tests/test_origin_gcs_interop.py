"""A bucket herd wrote, as GCS users see it: read back with the official ``google-cloud-storage``
client against the real ``gcp-storage-emulator`` process (content types, Cache-Control,
``herd-*`` metadata); and GCS's refusals as one line each -- a missing bucket from the
emulator itself, permission and quota errors (which the emulator cannot produce) from a
loopback server answering the way GCS does."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from blake3 import blake3

from infra.http import App, Request, Response, json_response, serve
from manifests import ChunkerParams, decode_manifest
from p2p.errors import NotFoundError, OriginError
from p2p.origins import open_origin
from p2p.origins.gcs import GCSOrigin
from p2p.publish import publish
from tests.gcs_emulator import gcs_emulator

BUCKET = "herd-interop"


@pytest.fixture
def emulator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with gcs_emulator(tmp_path / "emu", bucket=BUCKET) as host:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", host)
        yield host


def _tree(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "train").write_bytes(os.urandom(300_000))
    (root / "weights.bin").write_bytes(os.urandom(200_000))
    (root / "README").write_text("hello\n")
    return root


def _read_with_official_client(host: str, prefix: str) -> dict[str, dict[str, object]]:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(project="herd-test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": f"http://{host}"})
    out: dict[str, dict[str, object]] = {}
    for listed in client.list_blobs(BUCKET, prefix=prefix):
        blob = client.bucket(BUCKET).get_blob(listed.name)  # a metadata GET of its own
        assert blob is not None
        out[blob.name.removeprefix(prefix)] = {
            "content_type": blob.content_type, "cache_control": blob.cache_control,
            "metadata": dict(blob.metadata or {}), "size": blob.size, "data": blob.download_as_bytes()}
    return out


async def test_published_objects_read_back_with_google_cloud_storage(emulator: str, tmp_path: Path) -> None:
    pytest.importorskip("google.cloud.storage")
    params = ChunkerParams(min_size=16 << 10, avg_size=64 << 10, max_size=256 << 10)
    with trio.fail_after(60):
        async with open_origin(f"gs://{BUCKET}/team") as origin:
            stats = await publish(_tree(tmp_path / "tree"), origin, "trainer:v1", params)
        seen = await trio.to_thread.run_sync(_read_with_official_client, emulator, "team/")

    kinds: dict[str, list[str]] = {}
    for key in seen:
        kinds.setdefault(key.split("/", 1)[0], []).append(key)
    assert sorted(kinds) == ["chunks", "manifests", "refs"]
    assert len(kinds["chunks"]) == stats.chunks and kinds["refs"] == ["refs/trainer:v1"]

    for key in kinds["chunks"]:
        o = seen[key]
        assert o["content_type"] == "application/octet-stream"
        assert o["cache_control"] == "max-age=31536000, immutable"
        assert o["metadata"] == {"herd-kind": "chunk"}
        assert blake3(o["data"]).hexdigest() == key.removeprefix("chunks/")  # type: ignore[arg-type]

    man = seen[f"manifests/{stats.manifest}"]
    assert man["content_type"] == "application/vnd.herd.manifest+msgpack"
    assert man["cache_control"] == "max-age=31536000, immutable"
    m = decode_manifest(man["data"], expected_id=stats.manifest)  # type: ignore[arg-type]
    assert man["metadata"] == {"herd-kind": "manifest", "herd-ref": "trainer:v1", "herd-format": str(m.version),
                               "herd-size": str(stats.bytes), "herd-files": "3",
                               "herd-chunks": str(stats.chunks)}

    ref = seen["refs/trainer:v1"]
    assert ref["content_type"] == "text/plain; charset=utf-8"
    assert ref["cache_control"] == "no-cache"
    assert ref["metadata"] == {"herd-kind": "ref", "herd-manifest": stats.manifest}
    assert ref["data"] == stats.manifest.encode() + b"\n"


async def test_missing_bucket_is_one_line_from_the_emulator(emulator: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with open_origin("gs://no-such-bucket/x") as origin:
            with pytest.raises(OriginError) as e:
                await publish(_tree(tmp_path / "tree"), origin, "trainer:v1")
            assert str(e.value).startswith("origin gs://no-such-bucket/x: bucket 'no-such-bucket' does not exist")
            assert "gcloud storage buckets create gs://no-such-bucket" in str(e.value)
            with pytest.raises(OriginError, match="bucket 'no-such-bucket' does not exist") as e2:
                await origin.resolve("trainer:v1")
            assert not isinstance(e2.value, NotFoundError)
        # an existing bucket still says "unknown ref" for a ref it lacks
        async with open_origin(f"gs://{BUCKET}/x") as origin:
            with pytest.raises(NotFoundError, match="unknown ref 'nope:v1'"):
                await origin.resolve("nope:v1")


# ------------------------------------------------- refusals the emulator cannot produce

def _gcs_error(code: int, reason: str, message: str) -> Response:
    return json_response({"error": {"code": code, "message": message,
                                    "errors": [{"domain": "global", "reason": reason, "message": message}]}},
                         status=code)


class RefusingGCS:
    """Answers the way GCS does when the credentials lack a permission or a quota is hit."""

    def __init__(self) -> None:
        self.gets = 0
        app = self.app = App()
        app.add("POST", "/upload/storage/v1/b/{bucket}/o", self.upload)
        app.add("GET", "/storage/v1/b/{bucket}/o", self.list)
        app.add("GET", "/storage/v1/b/{bucket}/o/{prefix}/{kind}/{name}", self.get)

    async def upload(self, req: Request) -> Response:
        return _gcs_error(403, "forbidden", "herd-ci@proj.iam.gserviceaccount.com does not have "
                          "storage.objects.create access to the Google Cloud Storage object. Permission "
                          "'storage.objects.create' denied on resource (or it may not exist).")

    async def list(self, req: Request) -> Response:
        return _gcs_error(403, "forbidden", "")  # no message: herd names what listing needs

    async def get(self, req: Request) -> Response:
        self.gets += 1
        return _gcs_error(429, "rateLimitExceeded", "The object exceeded the rate limit for object "
                          "mutation operations (create, update, and delete).")


async def test_permission_and_quota_errors_are_one_line_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    fake = RefusingGCS()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve, fake.app, "127.0.0.1:0")
            o = GCSOrigin("bkt", "p", base_url=url, retries=2)
            o.http.backoff_base = 0.001
            async with o:
                with pytest.raises(OriginError) as e:
                    await o.put_chunk(blake3(b"x").hexdigest(), b"x")
                assert str(e.value) == (
                    "origin gs://bkt/p: permission denied: herd-ci@proj.iam.gserviceaccount.com needs "
                    f"storage.objects.create on gs://bkt (upload chunks/{blake3(b'x').hexdigest()}); grant a "
                    "role with it (roles/storage.objectViewer to fetch, roles/storage.objectUser to publish "
                    "and gc)")
                with pytest.raises(OriginError, match=r"^origin gs://bkt/p: permission denied: the credentials "
                                   r"in use need storage\.objects\.list on gs://bkt \(list p/chunks/\)"):
                    await o.list_objects("chunks/")
                with pytest.raises(OriginError) as e:
                    await o.resolve("app:v1")
                line = str(e.value)
                assert "\n" not in line and line.startswith("origin gs://bkt/p: GET ")
                assert line.endswith("failed after 3 attempts: GCS quota or rate limit exceeded "
                                     "(rateLimitExceeded, HTTP 429) (The object exceeded the rate limit for "
                                     "object mutation operations (create, update, and delete).)")
                assert fake.gets == 3
            nursery.cancel_scope.cancel()


def test_refusal_classification_table() -> None:
    from p2p.origins.gcs_objects import Failure, classify

    def kind(status: int, reason: str = "", message: str = "", action: str = "get") -> Failure:
        body = json.dumps({"error": {"code": status, "message": message, "errors": [{"reason": reason}]}})
        return classify(status, body.encode(), action=action, bucket="b", key="k").kind

    assert kind(404, "notFound", "The specified bucket does not exist.") is Failure.BUCKET_MISSING
    assert kind(404, "notFound", "", action="upload") is Failure.BUCKET_MISSING
    assert kind(404, "notFound", "", action="list") is Failure.BUCKET_MISSING
    assert kind(403, "forbidden", "x does not have storage.objects.get access") is Failure.PERMISSION
    assert kind(403, "quotaExceeded", "Quota exceeded") is Failure.QUOTA
    assert kind(429, "rateLimitExceeded") is Failure.QUOTA
    assert kind(403, "accountDisabled", "The billing account is disabled") is Failure.BILLING
    assert kind(401, "required") is Failure.CREDENTIALS
    assert kind(400, "invalid") is Failure.OTHER
    # a body that is not GCS's JSON still gives one line
    r = classify(403, b"<html>\nforbidden\n</html>", action="delete", bucket="b", key="refs/x")
    assert r.kind is Failure.PERMISSION and "storage.objects.delete" in r.line and "\n" not in r.line
