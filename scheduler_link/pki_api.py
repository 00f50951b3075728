"""The placer's certificate routes: bootstrap (a single-use token buys a node one certificate)
and renewal (a node's live certificate buys its successor). Both sign a CSR with the CA of
the placer's ``ca_dir``; without one they answer 404 (the operator issues certificates with
``herd pki issue`` instead).

* ``POST /v1/pki/bootstrap`` -- body :class:`CSRRequest` (``node_id`` and the CSR), the bootstrap
  token as the bearer token. The token is consumed (on disk, under the store's lock) before the
  certificate is returned: a token buys one certificate, also across placer restarts; its
  failures are 401 with the reason (unknown, expired, used, bound to another node).
* ``POST /v1/pki/renew`` -- body :class:`CSRRequest`, over the node's own mutual-TLS connection:
  the CSR must name the node of the presented certificate (node restriction).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from infra import pki
from infra.auth import bearer
from infra.http import HTTPError, Request, Response, RouteDoc, json_response

log = logging.getLogger("herd.pki")


class CSRRequest(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    csr: str                 # PEM


class CertReply(msgspec.Struct, frozen=True, kw_only=True):
    cert: str                # PEM, the node's new certificate
    ca: str                  # PEM, the cluster CA
    not_after: str           # ISO 8601


class PKIRoutes:
    """The two handlers; ``ca_dir`` None turns both off (404)."""

    def __init__(self, ca_dir: str | os.PathLike[str] | None, *, days: int = pki.NODE_DAYS,
                 clock: Callable[[], float] = time.time) -> None:
        self.ca_dir = Path(ca_dir) if ca_dir else None
        self.days = days
        self.clock = clock
        self.tokens = pki.BootstrapTokens(self.ca_dir / "bootstrap-tokens.json") if self.ca_dir else None
        self.issued = {"bootstrap": 0, "renew": 0, "refused": 0}

    def _ca(self) -> pki.CA:
        if self.ca_dir is None:
            raise HTTPError(404, "certificate signing is off", "this placer has no ca_dir")
        try:
            return pki.CA.load(self.ca_dir)
        except pki.PKIError as e:
            raise HTTPError(503, "the placer cannot sign", str(e)) from None

    def _sign(self, req: Request, node_id: str, body: CSRRequest, how: str) -> Response:
        ca = self._ca()
        try:
            cert = pki.sign_csr(ca, body.csr.encode(), node_id, days=self.days,
                                names=[req.client] if req.client else ())
        except pki.PKIError as e:
            self.issued["refused"] += 1
            raise HTTPError(400, "certificate request refused", str(e)) from None
        self.issued[how] += 1
        log.info("certificate issued how=%s node=%s not_after=%s", how, node_id, cert.not_valid_after_utc.isoformat())
        return json_response(CertReply(cert=pki.cert_pem(cert).decode(), ca=pki.cert_pem(ca.cert).decode(),
                                       not_after=cert.not_valid_after_utc.isoformat()))

    async def h_bootstrap(self, req: Request) -> Response:
        """A new node's first certificate for a single-use bootstrap token (its bearer token)."""
        body = req.decode(CSRRequest)
        token = bearer(req.headers)
        if self.tokens is None:
            raise HTTPError(404, "certificate signing is off", "this placer has no ca_dir")
        if not token:
            raise HTTPError(401, "unauthorized", "needs a bootstrap token (herd pki bootstrap-token)")
        if not body.node_id or "/" in body.node_id:
            raise HTTPError(400, "bad node id", body.node_id[:200])
        self._ca()
        try:
            self.tokens.consume(token, body.node_id, now=self.clock())
        except pki.PKIError as e:
            self.issued["refused"] += 1
            log.warning("bootstrap refused node=%s client=%s: %s", body.node_id[:200], req.client, e)
            raise HTTPError(401, "bootstrap token refused", str(e)) from None
        return self._sign(req, body.node_id, body, "bootstrap")

    async def h_renew(self, req: Request) -> Response:
        """A node's next certificate, asked over its current one (the CSR must name that node)."""
        p = req.principal
        if p is None or p.via != "cert" or p.kind != "node" or p.node_id is None:
            raise HTTPError(403, "forbidden", "renewal needs the node's current client certificate")
        body = req.decode(CSRRequest)
        if body.node_id != p.node_id:
            raise HTTPError(403, "forbidden", f"this certificate is node:{p.node_id}; it may not renew "
                                              f"node {body.node_id[:200]}")
        return self._sign(req, p.node_id, body, "renew")


# OpenAPI descriptions of the placer's certificate and status routes
PLACER_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/pki/bootstrap"): RouteDoc(
        summary="A new node's first certificate, for a single-use bootstrap token",
        body=CSRRequest, responses={200: CertReply},
        errors={401: "no, unknown, expired, used or another node's bootstrap token",
                404: "certificate signing is off (no ca_dir)"}),
    ("POST", "/v1/pki/renew"): RouteDoc(
        summary="A node's next certificate, asked over its current one",
        body=CSRRequest, responses={200: CertReply},
        errors={403: "not the node's own certificate", 404: "certificate signing is off (no ca_dir)"}),
    ("GET", "/v1/status"): RouteDoc(
        summary="Transport security: TLS or insecure, accept_tokens and the token-authenticated agents",
        responses={200: {"type": "object"}}),
}
