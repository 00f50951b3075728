"""GCS credentials the way every Google client finds them: ``google.auth.default()``.

That one call covers, in this order: ``GOOGLE_APPLICATION_CREDENTIALS`` naming a
service-account key, an authorized-user file or a workload-identity-federation
(``external_account``) configuration; gcloud's application-default file
(``$CLOUDSDK_CONFIG`` or ``~/.config/gcloud/application_default_credentials.json``,
written by ``gcloud auth application-default login``); then the GCE/GKE metadata
server. Writing our own lookup (as herd once did) got the less common of these wrong.

google-auth is synchronous: loading and refreshing run in a worker thread, over a
small httpx transport (``requests`` is not a dependency of herd). The token is refreshed
before it expires (google-auth's own margin, 3 min 45 s) and whenever a 401 says it is
no longer good (``headers(force=True)``, called by the retrying client). Every failure
becomes one ``OriginError`` line that names the credential source.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import google.auth
import google.auth.credentials
import google.auth.exceptions
import google.auth.transport
import httpx
import trio

from ..errors import OriginError, OriginUnavailable

log = logging.getLogger("herd.p2p.origin.gcs")

SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_RESOURCE_MANAGER = "cloudresourcemanager.googleapis.com"


class _Response(google.auth.transport.Response):
    def __init__(self, r: httpx.Response) -> None:
        self._r = r

    @property
    def status(self) -> int:
        return self._r.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._r.headers

    @property
    def data(self) -> bytes:
        return self._r.content


class HttpxRequest(google.auth.transport.Request):
    """google-auth's transport interface over synchronous httpx (run in a worker thread:
    every wait is bounded, since a thread blocked on a socket cannot be cancelled)."""

    def __call__(self, url: str, method: str = "GET", body: Any = None, headers: Any = None,
                 timeout: Any = None, **kwargs: Any) -> _Response:
        if httpx.URL(url).host == _RESOURCE_MANAGER:
            # google.auth.default() looks up the project of a workload-identity configuration at
            # Resource Manager; herd names buckets, never projects. Answering "no project"
            # here keeps loading off the network (and working where only GCS is reachable).
            return _Response(httpx.Response(404, content=b"{}"))
        t = float(timeout) if timeout else 30.0
        try:
            r = httpx.request(method, url, content=body, headers=headers,
                              timeout=httpx.Timeout(t, connect=min(t, 5.0)))
        except httpx.HTTPError as e:
            raise google.auth.exceptions.TransportError(f"{type(e).__name__}: {e}") from e
        return _Response(r)


def describe_source(creds: object) -> str:
    """A short name for where credentials came from (for logs and error lines)."""
    mod = type(creds).__module__
    if mod.startswith("google.oauth2.service_account"):
        return "service-account key"
    if mod.startswith("google.oauth2.credentials"):
        return "authorized-user credentials"
    if mod.startswith(("google.auth.identity_pool", "google.auth.aws", "google.auth.pluggable",
                       "google.auth.external_account")):
        return "workload identity federation"
    if mod.startswith("google.auth.compute_engine"):
        return "GCE metadata server"
    if mod.startswith("google.auth.impersonated_credentials"):
        return "impersonated service account"
    return type(creds).__name__


def _first_line(e: BaseException) -> str:
    text = str(e.args[0]) if e.args and isinstance(e.args[0], str | BaseException) else str(e)
    return text.strip().splitlines()[0][:300] if text.strip() else type(e).__name__


def load_default(request: google.auth.transport.Request | None = None) -> google.auth.credentials.Credentials:
    """``google.auth.default()`` with its failures mapped to one OriginError line. Blocking."""
    request = request or HttpxRequest()
    named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")
    try:
        with warnings.catch_warnings():
            # gcloud's own client id draws a UserWarning about quota projects; say it once in the log.
            warnings.simplefilter("ignore", UserWarning)
            creds, _project = google.auth.default(scopes=[SCOPE], request=request)
    except google.auth.exceptions.DefaultCredentialsError as e:
        if named:
            raise OriginError(f"cannot use GOOGLE_APPLICATION_CREDENTIALS={named}: {_first_line(e)}") from None
        raise OriginError(
            "no GCS credentials: GOOGLE_APPLICATION_CREDENTIALS is not set, there is no gcloud "
            "application-default file (gcloud auth application-default login) and no GCE metadata "
            "server answered") from None
    except google.auth.exceptions.GoogleAuthError as e:
        raise OriginError(f"cannot load GCS credentials: {_first_line(e)}") from None
    return creds


class GoogleCredentials:
    """Credentials for the GCS origin: loaded on the first request that really talks to GCS,
    refreshed before expiry and on demand. Safe to share between tasks (one lock)."""

    def __init__(self) -> None:
        self._creds: google.auth.credentials.Credentials | None = None
        self._request = HttpxRequest()
        self._lock = trio.Lock()
        self.refreshes = 0
        self.source = ""

    @property
    def credentials(self) -> google.auth.credentials.Credentials | None:
        """The google-auth credentials once loaded (None before the first request)."""
        return self._creds

    def _refresh_sync(self, creds: google.auth.credentials.Credentials) -> None:
        try:
            creds.refresh(self._request)
        except google.auth.exceptions.GoogleAuthError as e:
            # the token endpoint unreachable may pass (asked again by the caller's retry
            # layer); refused credentials will not
            cls = OriginUnavailable if isinstance(e, google.auth.exceptions.TransportError) else OriginError
            raise cls(f"GCS token refresh failed ({self.source}): {_first_line(e)}") from None

    async def headers(self, force: bool) -> dict[str, str]:
        """The request headers that authenticate (``authorization``, and ``x-goog-user-project``
        where the credentials name a quota project). ``force``: the last token was refused."""
        async with self._lock:
            creds = self._creds
            if creds is None:
                creds = await trio.to_thread.run_sync(load_default, self._request)
                self.source = describe_source(creds)
                self._creds = creds
            if force or not creds.valid:
                await trio.to_thread.run_sync(self._refresh_sync, creds)
                self.refreshes += 1
                log.info("gcs credentials refreshed source=%s forced=%s expiry=%s", self.source, force,
                         creds.expiry.isoformat() if creds.expiry else "none")
            out: dict[str, str] = {}
            creds.apply(out)
            return out
