"""A synchronous HTTP client for one herd daemon (an agent's control API, a placer's
health check) that fails in our errors, not httpx's.

httpx's exceptions enter here and leave as :class:`ClientError` with one line that names
the daemon and its URL: no answer in time, no connection, a stream that broke, an error
answer (the daemon's ``{"error", "detail"}``), or an answer that is not a herd daemon's.
The CLI catches ``ClientError`` (it is a :class:`~infra.errors.LinkError`) and
prints the line; it never sees an httpx exception. :class:`~scheduler_link.client.PlacerClient`
is the placer's typed client over the same rules.

``expect`` names who must answer (``placer``, ``node``, ``node:X``): over https it is checked
inside the TLS handshake, before the request leaves. A bearer token never goes to a node over
https: an agent is a host that may be compromised, so the operator acts on it with the
operator's certificate (mutual TLS, proof of possession: nothing an agent sees can be replayed
elsewhere), never with the fleet-wide operator token; the ``authorization`` header is dropped.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import msgspec

from infra.errors import ClientError

from .client import error_line, not_herd_line, transport_error, verify_for

_any = msgspec.json.Decoder()


class DaemonClient:
    """Requests to the daemon at ``url`` (``who`` names it in errors: "agent", "placer"). An
    https URL is verified against the cluster CA of the TLS dir (``verify_for``, as the placer's
    client does) unless ``verify`` says otherwise."""

    def __init__(self, url: str, who: str, *, timeout: float, headers: Mapping[str, str] | None = None,
                 verify: ssl.SSLContext | bool | None = None, expect: str | None = None,
                 tls_dir: str | os.PathLike[str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.who = who
        if verify is None:
            verify = verify_for(self.url, tls_dir, expect=expect)
        # over TLS, a node gets no bearer token (the operator's certificate speaks instead)
        self.no_bearer = self.url.startswith("https://") and expect is not None and (expect == "node" or expect.startswith("node:"))
        self._c = httpx.Client(base_url=self.url, headers=self._allowed(headers), timeout=timeout, verify=verify)

    def _allowed(self, headers: Mapping[str, str] | None) -> dict[str, str]:
        return {k: v for k, v in (headers or {}).items() if not (self.no_bearer and k.lower() == "authorization")}

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._c.close()

    def send(self, method: str, path: str, *, stream: bool = False, unbounded_read: bool = False,
             check: bool = True, **kw: Any) -> httpx.Response:
        """The answer; an error answer (>= 400) is a ClientError with its ``status`` unless
        ``check`` is false. ``unbounded_read`` waits for each piece of a stream without a
        bound (a follow; the connect timeout still holds)."""
        if unbounded_read:
            kw["timeout"] = httpx.Timeout(self._c.timeout.connect, read=None)
        if "headers" in kw:
            kw["headers"] = self._allowed(kw["headers"])
        try:
            r = self._c.send(self._c.build_request(method, path, **kw), stream=stream)
        except httpx.HTTPError as e:
            raise transport_error(e, self.who, self.url) from None
        if check and r.status_code >= 400:
            if stream:
                self._read_quietly(r)
            raise ClientError(error_line(r, self.who), status=r.status_code)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        """A 2xx answer's JSON body; a body that is not JSON is 'not a herd server'."""
        return self.decode(self.send(method, path, **kw))

    def decode(self, r: httpx.Response) -> Any:
        try:
            return _any.decode(r.content)
        except msgspec.DecodeError:
            raise ClientError(not_herd_line(r, self.who)) from None

    def iter_bytes(self, r: httpx.Response) -> Iterator[bytes]:
        """A streamed answer's bytes; a stream that breaks is a ClientError. Closes ``r``."""
        try:
            yield from r.iter_bytes()
        except httpx.HTTPError as e:
            raise ClientError(f"the stream from the {self.who} at {self.url} broke: "
                              f"{e or type(e).__name__}") from None
        finally:
            r.close()

    def _read_quietly(self, r: httpx.Response) -> None:
        try:
            r.read()
        except httpx.HTTPError:
            pass  # the status is the answer; a body cut short only loses its detail
        finally:
            r.close()


async def get_json(c: httpx.AsyncClient, url: str, who: str, **kw: Any) -> tuple[int, Any]:
    """``(status, JSON body or None)`` of a GET with an open async client; no answer, or an
    answer that is not JSON, is a ClientError."""
    try:
        r = await c.get(url, **kw)
    except httpx.HTTPError as e:
        raise transport_error(e, who, url) from None
    try:
        return r.status_code, _any.decode(r.content) if r.status_code < 400 else None
    except msgspec.DecodeError:
        raise ClientError(not_herd_line(r, who)) from None
