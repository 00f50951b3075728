"""The placer's certificate routes: bootstrap (a single-use token buys a node one certificate)
and renewal (a node's live certificate buys its successor). Both sign a CSR with the CA of
the placer's ``ca_dir``; without one they answer 404 (the operator issues certificates with
``herd pki issue`` instead).

* ``POST /v1/pki/bootstrap`` -- body :class:`CSRRequest` (``node_id`` and the CSR), the bootstrap
  token as the bearer token. The token is checked first, without the store's lock and before
  the CA key is loaded (a flood of wrong tokens costs a file read each); then a revoked node id
  (403) or one that holds a live certificate (409: renewal is the way) is refused; then the
  token is consumed (on disk, under the store's lock, in a worker thread) before the
  certificate is returned: a token buys one certificate, also across placer restarts; its
  failures are 401 with the reason (unknown, expired, used, bound to another node).
* ``POST /v1/pki/renew`` -- body :class:`CSRRequest`, over the node's own mutual-TLS connection:
  the CSR must name the node of the presented certificate (node restriction); a revoked node
  is refused (its handshake already is, wherever the deny-list was loaded).

The rack a certificate pins (``herd:rack:`` SAN URI, :mod:`infra.pki`): a bootstrap's comes
from its token (``herd pki bootstrap-token --rack``), a renewal's from the certificate it is
asked over -- never from the request, so a node cannot move itself to another rack by renewing
(nor drop its pin); an operator moves it by issuing (``herd pki issue --node ID --rack``).

Every answer carries the certificate's enrolment key (:func:`infra.pki.enrol_key`, from the
``enrol.secret`` of ``ca_dir``, made there when missing): the node keeps it beside its key and
enrols through its relay without an ECDH (scheduler_link.enroll). It is as secret as the
node's key and travels only over the TLS connection the node verified the placer on.

Every certificate issued is recorded (:class:`infra.pki.Issued`) before it is returned. The
deny-list (``<ca_dir>/revoked.json``, ``herd pki revoke``) is re-read when the file changes
(:meth:`PKIRoutes.refresh`, on the placer's tick) into the placer's handshakes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import trio
from cryptography import x509

from infra import pki
from infra.auth import bearer
from infra.http import HTTPError, Request, Response, RouteDoc, json_response
from infra.tls import Revoked

log = logging.getLogger("herd.pki")


class CSRRequest(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    csr: str                 # PEM


class CertReply(msgspec.Struct, frozen=True, kw_only=True):
    cert: str                # PEM, the node's new certificate
    ca: str                  # PEM, the cluster CA
    not_after: str           # ISO 8601
    # hex: the certificate's enrolment key (infra.pki.enrol_key), secret: kept beside the node's
    # key as node.enrol; with it the node enrols through its relay with no ECDH (None: an older placer)
    enrol_key: str | None = None


@dataclass(frozen=True, slots=True)
class _Refusal:
    status: int
    error: str
    detail: str


class PKIRoutes:
    """The two handlers; ``ca_dir`` None turns both off (404)."""

    def __init__(self, ca_dir: str | os.PathLike[str] | None, *, days: int = pki.NODE_DAYS,
                 clock: Callable[[], float] = time.time) -> None:
        self.ca_dir = Path(ca_dir) if ca_dir else None
        self.days = days
        self.clock = clock
        self.tokens = pki.BootstrapTokens(self.ca_dir / "bootstrap-tokens.json") if self.ca_dir else None
        self.revocations = pki.Revocations(self.ca_dir) if self.ca_dir else None
        self.issued = {"bootstrap": 0, "renew": 0, "refused": 0}
        self.denied: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        self._denied_stamp: tuple[int, int, int] | None = None

    def refresh(self, into: Revoked) -> list[str] | None:
        """Re-read the deny-list when its file changed and load it into ``into`` (the placer's
        handshakes): None when it did not change, else the node ids newly denied (to fence).
        A file that cannot be read keeps the list held (logged)."""
        if self.revocations is None:
            return None
        try:
            st = os.stat(self.revocations.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = (0, 0, 0)
        except OSError as e:
            log.warning("cannot read the deny-list %s: %s", self.revocations.path, e)
            return None
        if stamp == self._denied_stamp:
            return None
        try:
            denied = self.revocations.load() if stamp != (0, 0, 0) else (frozenset(), frozenset())
        except pki.PKIError as e:
            log.warning("deny-list not loaded (the one held stays): %s", e)
            return None
        self._denied_stamp = stamp
        new = sorted(denied[0] - self.denied[0])
        self.denied = denied
        if into.replace(*denied):
            log.warning("deny-list loaded nodes=%d serials=%d newly_denied=%s", len(denied[0]), len(denied[1]),
                        ",".join(new[:20]) or "-")
        return new

    def _issue(self, node_id: str, csr: bytes, names: list[str], token: str | None, now: float,
               rack: str | None = None) -> tuple[pki.CA, x509.Certificate] | _Refusal:
        """The blocking part (a worker thread): consume the bootstrap token (when one), load
        the CA, sign, record the certificate. A refusal comes back as (status, error, detail).
        ``rack``: the pinned rack of the certificate renewed (a bootstrap takes its token's)."""
        if token is not None:
            assert self.tokens is not None
            try:
                rack = self.tokens.consume(token, node_id, now=now)
            except pki.PKIError as e:
                return _Refusal(401, "bootstrap token refused", str(e))
        assert self.ca_dir is not None
        try:
            ca = pki.CA.load(self.ca_dir)
        except pki.PKIError as e:
            return _Refusal(503, "the placer cannot sign", str(e))
        try:
            cert = pki.sign_csr(ca, csr, node_id, days=self.days, names=names, rack=rack)
            # a bootstrap is recorded only if no live certificate of the node was meanwhile
            denied = self.revocations.load() if token is not None and self.revocations is not None else None
            live = pki.Issued(self.ca_dir).record(node_id, cert, now=now, unless_live=denied)
        except pki.PKIError as e:
            return _Refusal(400, "certificate request refused", str(e))
        if live:
            return _Refusal(409, "node holds a live certificate", f"node {node_id[:200]} holds a live certificate "
                                                                  f"(serial {live[0]}), issued meanwhile")
        return ca, cert

    async def _sign(self, req: Request, node_id: str, body: CSRRequest, how: str, token: str | None = None,
                    rack: str | None = None) -> Response:
        if self.ca_dir is None:
            raise HTTPError(404, "certificate signing is off", "this placer has no ca_dir")
        out = await trio.to_thread.run_sync(self._issue, node_id, body.csr.encode(),
                                            [req.client] if req.client else [], token, self.clock(), rack)
        if isinstance(out, _Refusal):
            self.issued["refused"] += 1
            log.warning("certificate refused how=%s node=%s client=%s: %s", how, node_id[:200], req.client,
                        out.detail)
            raise HTTPError(out.status, out.error, out.detail)
        ca, cert = out
        self.issued[how] += 1
        log.info("certificate issued how=%s node=%s not_after=%s rack=%s", how, node_id,
                 cert.not_valid_after_utc.isoformat(), pki.cert_rack(cert) or "-")
        master = pki.enrol_master(self.ca_dir, create=True)
        return json_response(CertReply(cert=pki.cert_pem(cert).decode(), ca=pki.cert_pem(ca.cert).decode(),
                                       not_after=cert.not_valid_after_utc.isoformat(),
                                       enrol_key=pki.enrol_key_of(master, cert).hex() if master else None))

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
        now = self.clock()
        try:  # no lock, no CA key: a wrong token costs one small read
            self.tokens.check(token, body.node_id, now=now)
        except pki.PKIError as e:
            self._refused(req, body.node_id, e)
            raise HTTPError(401, "bootstrap token refused", str(e)) from None
        self._check_node(body.node_id, now, "bootstrap")
        return await self._sign(req, body.node_id, body, "bootstrap", token)

    def _refused(self, req: Request, node_id: str, e: Exception) -> None:
        self.issued["refused"] += 1
        log.warning("bootstrap refused node=%s client=%s: %s", node_id[:200], req.client, e)

    def _check_node(self, node_id: str, now: float, how: str) -> None:
        """A revoked node gets no certificate (403); a bootstrap for a node that holds a live
        one is refused (409): that node renews over it, or the operator revokes it first."""
        assert self.ca_dir is not None
        try:
            denied = self.revocations.load() if self.revocations is not None else self.denied
            live = pki.Issued(self.ca_dir).live(node_id, denied, now=now) if how == "bootstrap" else []
        except pki.PKIError as e:
            raise HTTPError(503, "the placer cannot sign", str(e)) from None
        if node_id in denied[0]:
            self.issued["refused"] += 1
            log.warning("certificate refused how=%s node=%s: revoked", how, node_id[:200])
            raise HTTPError(403, "node revoked", f"node {node_id[:200]} is revoked (herd pki revoke)")
        if live:
            self.issued["refused"] += 1
            log.warning("bootstrap refused node=%s: holds a live certificate serial=%s", node_id[:200], live[0])
            raise HTTPError(409, "node holds a live certificate",
                            f"node {node_id[:200]} holds a live certificate (serial {live[0]}): it renews over "
                            "that one; revoke it first (herd pki revoke) to bootstrap it again")

    async def h_renew(self, req: Request) -> Response:
        """A node's next certificate, asked over its current one (the CSR must name that node)."""
        p = req.principal
        if p is None or p.via != "cert" or p.kind != "node" or p.node_id is None:
            raise HTTPError(403, "forbidden", "renewal needs the node's current client certificate")
        body = req.decode(CSRRequest)
        if body.node_id != p.node_id:
            raise HTTPError(403, "forbidden", f"this certificate is node:{p.node_id}; it may not renew "
                                              f"node {body.node_id[:200]}")
        if self.ca_dir is None:
            raise HTTPError(404, "certificate signing is off", "this placer has no ca_dir")
        self._check_node(p.node_id, self.clock(), "renew")
        return await self._sign(req, p.node_id, body, "renew", rack=p.rack)   # (the pin goes on unchanged)


# OpenAPI descriptions of the placer's certificate and status routes
PLACER_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/pki/bootstrap"): RouteDoc(
        summary="A new node's first certificate, for a single-use bootstrap token",
        body=CSRRequest, responses={200: CertReply},
        errors={401: "no, unknown, expired, used or another node's bootstrap token",
                403: "the node is revoked", 409: "the node holds a live certificate (it renews over it)",
                404: "certificate signing is off (no ca_dir)"}),
    ("POST", "/v1/pki/renew"): RouteDoc(
        summary="A node's next certificate, asked over its current one",
        body=CSRRequest, responses={200: CertReply},
        errors={403: "not the node's own certificate, or the node is revoked",
                404: "certificate signing is off (no ca_dir)"}),
    ("GET", "/v1/status"): RouteDoc(
        summary="Transport security: TLS or insecure, accept_tokens and the token-authenticated agents",
        responses={200: {"type": "object"}}),
}
