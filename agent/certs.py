"""The agent's certificate: where it is, bootstrap (a single-use token buys the first one) and
renewal before expiry (over the current one). docs/security.md says who holds what.

Where: ``tls_dir`` (default ``$HERD_TLS_DIR`` or ``/etc/herd/tls``; under systemd the unit's
``LoadCredential=`` directory) holds ``ca.crt`` and, when issued by the operator
(``herd pki issue``), ``node.crt`` + ``node.key``. A certificate the agent obtained itself
(bootstrap or renewal) is written to ``<state_dir>/tls/`` (0600, atomic) and preferred while
it is the later one: a read-only credentials dir never blocks a renewal. Beside the key,
``node.enrol`` holds the certificate's enrolment key (from ``herd pki issue``, or in the
placer's answer to a bootstrap or renewal): with it the agent enrols through its relay with no
ECDH (scheduler_link.enroll); it is as secret as the key.

Renewal: once less than a third of the certificate's lifetime is left, the agent posts a CSR
for a fresh key to the placer's ``/v1/pki/renew`` over mutual TLS with its current certificate,
writes the answer and loads it into its live TLS contexts (new connections present it). A
renewed certificate must pin the rack the current one pins (``herd:rack:``, infra.pki): the
placer copies it, and one that does not (a placer of an older version) is not installed: the
node keeps its current certificate, and its pin, and says why.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx
import msgspec
import trio
from cryptography import x509

from infra import pki
from infra.durable import atomic_write
from infra.tls import (
    DEFAULT_TLS_DIR,
    Security,
    TLSError,
    TLSFiles,
    client_context,
    daemon_security,
    describe_ssl_error,
    insecure_from_env,
    ssl_cause,
)
from scheduler_link.pki_api import CertReply, CSRRequest

from .config import AgentConfig
from .errors import AgentError

log = logging.getLogger("herd.agent.certs")

RENEW_CHECK_S = 3600.0


def tls_dir(configured: str | None) -> Path:
    return Path(configured or os.environ.get("HERD_TLS_DIR") or DEFAULT_TLS_DIR)


def _present(p: Path) -> bool:
    """A file with content (systemd's SetCredential= default for an absent file is a newline)."""
    try:
        return p.is_file() and p.stat().st_size > 1
    except OSError:
        return False


def node_files(configured: str | None, state_dir: str | os.PathLike[str]) -> TLSFiles:
    """The agent's TLS material: its own (bootstrapped/renewed) certificate in the state dir
    when there is one and it is the later one, else the configured dir's."""
    d = tls_dir(configured)
    given = TLSFiles.in_dir(d, "node")
    own_dir = Path(state_dir) / "tls"
    own = TLSFiles(given.ca, own_dir / "node.crt", own_dir / "node.key")
    if not (_present(own.cert) and _present(own.key)):
        return given
    if not _present(given.cert):
        return own
    try:
        later = pki.load_cert(own.cert).not_valid_after_utc >= pki.load_cert(given.cert).not_valid_after_utc
    except pki.PKIError:
        return given
    return own if later else given


def _parse(pem: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem.encode())
    except ValueError as e:
        raise pki.PKIError(f"not a PEM certificate: {e}") from None


def _save(state_dir: str | os.PathLike[str], key_pem: bytes, reply: CertReply) -> TLSFiles:
    d = Path(state_dir) / "tls"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    atomic_write(d / "node.key", key_pem, 0o600)
    if reply.enrol_key:   # (beside the key it goes with; bound to the certificate's serial)
        try:
            key = bytes.fromhex(reply.enrol_key)
        except ValueError:
            raise pki.PKIError("the placer's answer holds an enrolment key that is not hex") from None
        pki.write_enrol_key(d / "node.key", _parse(reply.cert), key)
    else:                 # (an older placer: the one there is another certificate's)
        (d / "node.key").with_suffix(pki.ENROL_SUFFIX).unlink(missing_ok=True)
    atomic_write(d / "node.crt", reply.cert.encode(), 0o644)
    return TLSFiles(d / "ca.crt", d / "node.crt", d / "node.key")


async def _post_csr(placer: str, path: str, body: CSRRequest, *, verify: object,
                    token: str | None = None) -> CertReply:
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    try:
        async with httpx.AsyncClient(verify=verify, timeout=10.0) as c:  # type: ignore[arg-type]  # verify is an SSLContext or a CA path from tls.client_verify, typed object there
            r = await c.post(f"{placer.rstrip('/')}{path}", content=msgspec.json.encode(body), headers=headers)
    except httpx.HTTPError as e:
        cause = ssl_cause(e)
        raise AgentError(f"certificate request to the placer at {placer} failed: "
                         f"{describe_ssl_error(cause or e) if cause or 'SSL' in str(e) else e}") from None
    if r.status_code != 200:
        raise AgentError(f"the placer refused the certificate request ({r.status_code}): {r.text[:300]}")
    try:
        return msgspec.json.decode(r.content, type=CertReply)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise AgentError(f"the placer's certificate answer is malformed: {e}") from None


async def bootstrap(placer: str, node_id: str, token: str, *, configured_dir: str | None,
                    state_dir: str | os.PathLike[str]) -> TLSFiles:
    """Post a CSR with the bootstrap token once; write the certificate to ``<state_dir>/tls``.
    The placer is verified against the configured dir's ``ca.crt`` (it must be there)."""
    ca = tls_dir(configured_dir) / "ca.crt"
    if not _present(ca):
        raise AgentError(f"bootstrap needs the cluster CA certificate at {ca} (copy ca.crt from the PKI dir)")
    try:
        ctx = client_context(ca, expect="placer")   # the token leaves only for the placer
    except TLSError as e:
        raise AgentError(str(e)) from None
    key, csr = pki.make_csr(node_id)
    reply = await _post_csr(placer, "/v1/pki/bootstrap", CSRRequest(node_id=node_id, csr=csr.decode()),
                            verify=ctx, token=token)
    files = _save(state_dir, pki.key_pem(key), reply)
    log.info("bootstrapped a node certificate node=%s not_after=%s", node_id, reply.not_after)
    return TLSFiles(ca, files.cert, files.key)


async def renew(security: Security, placer: str, node_id: str, state_dir: str | os.PathLike[str]) -> bool:
    """Renew now over the current certificate; True when a new one is in use."""
    assert security.files is not None and security.client is not None
    key, csr = pki.make_csr(node_id)
    reply = await _post_csr(placer, "/v1/pki/renew", CSRRequest(node_id=node_id, csr=csr.decode()),
                            verify=security.client)
    try:
        was, got = pki.cert_rack(pki.load_cert(security.files.cert)), pki.cert_rack(_parse(reply.cert))
    except pki.PKIError as e:
        raise AgentError(f"the renewed certificate cannot be read: {e}") from None
    if was != got:
        raise AgentError(f"the renewed certificate pins rack {got or '(none)'}, the current one {was or '(none)'}: "
                         "kept the current one (a renewal keeps the rack; the operator moves it with herd pki issue)")
    files = _save(state_dir, pki.key_pem(key), reply)
    new = TLSFiles(security.files.ca, files.cert, files.key)
    security.files = new
    security.reload()
    log.info("renewed the node certificate node=%s not_after=%s", node_id, reply.not_after)
    return True


async def renew_loop(security: Security, placer: str, node_id: str, state_dir: str | os.PathLike[str], *,
                     check_s: float = RENEW_CHECK_S, fraction: float = 1 / 3) -> None:
    """Check every ``check_s``; renew once less than ``fraction`` of the lifetime is left
    (a failure is logged and tried again at the next check)."""
    while True:
        if security.files is not None:
            try:
                cert = pki.load_cert(security.files.cert)
                if pki.needs_renewal(cert, fraction=fraction):
                    await renew(security, placer, node_id, state_dir)
            except (AgentError, pki.PKIError, TLSError) as e:
                log.warning("certificate renewal failed node=%s: %s", node_id, e)
        await trio.sleep(check_s)


def security_for(config: AgentConfig) -> Security | None:
    """The agent's TLS set-up from its config; None while a bootstrap is pending (no node
    certificate yet and a bootstrap token configured: :func:`bootstrap_security` in ``run``)."""
    what = f"agent {config.node_id}"
    if insecure_from_env(config.insecure):
        return daemon_security(None, "node", insecure=config.insecure, what=what)
    files = node_files(config.tls_dir, config.state_dir)
    if config.tls_bootstrap_token and not _present(files.cert):
        return None
    try:
        return daemon_security(None, "node", insecure=False, what=what, files=files)
    except TLSError as e:
        raise AgentError(str(e)) from None


async def bootstrap_security(config: AgentConfig) -> Security:
    """Bootstrap this node's first certificate with the configured token file, then its set-up."""
    if not config.placer:
        raise AgentError("bootstrap needs a placer (placer = https://...)")
    assert config.tls_bootstrap_token is not None
    try:
        token = (await trio.Path(config.tls_bootstrap_token).read_text()).strip()
    except OSError as e:
        raise AgentError(f"cannot read the bootstrap token file {config.tls_bootstrap_token}: {e}") from None
    files = await bootstrap(config.placer, config.node_id, token, configured_dir=config.tls_dir,
                            state_dir=config.state_dir)
    try:
        return daemon_security(None, "node", insecure=False, what=f"agent {config.node_id}", files=files)
    except TLSError as e:
        raise AgentError(str(e)) from None
