"""Which addresses an ``http(s)://`` origin may be read from.

An origin URL comes from a placement (checked against the agent's allow-list,
:mod:`p2p.origins.allow`), but the allow-list names hosts, and a host name resolves to
whatever its DNS says: an allowed mirror's name pointed at ``169.254.169.254`` (a cloud's
metadata server) or at ``127.0.0.1`` (the agent's own APIs) would make every agent a
server-side request forger. So, before a request leaves:

* a link-local address (``169.254.0.0/16``, ``fe80::/10``, also IPv4-mapped) is refused always,
  and so are the clouds' metadata addresses outside it (:data:`METADATA`: AWS's IPv6
  ``fd00:ec2::254``, Alibaba's ``100.100.100.200``);
* a loopback or unspecified address is refused unless the origin names loopback itself
  (``127.0.0.1``, ``[::1]``, ``localhost``): such a URL passed the allow-list only because the
  operator wrote that loopback origin there (tests and single-host set-ups run origins on
  loopback that way).

The host is resolved once per origin object and every address of the answer is checked (one
refused address refuses the origin); connections then go to a checked address
(:meth:`AddressGuard.addresses`, used by the lean client and by httpx through
:class:`PinnedBackend`), never through a second lookup, so a DNS answer that changes after the
check (rebinding) reaches nothing. The request keeps the URL's host name: its ``Host`` header,
and with https its SNI and the name the certificate is checked against.

Redirects are not followed at all (:mod:`p2p.origins.transport`), so an allowed origin cannot
bounce a request elsewhere.
"""

from __future__ import annotations

import ipaddress
import socket
import typing
from urllib.parse import urlsplit

import httpcore
import trio

from ..errors import OriginError

_LOOPBACK_NAMES = frozenset({"localhost", "localhost."})
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# metadata servers outside the link-local ranges
METADATA = frozenset({ipaddress.ip_address("fd00:ec2::254"), ipaddress.ip_address("100.100.100.200")})


def address_refusal(addr: IPAddress, *, loopback_ok: bool) -> str | None:
    """Why an origin may not be read at ``addr``, or None. Pure."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_link_local:
        return f"{addr} is a link-local address (a metadata server's range)"
    if addr in METADATA:
        return f"{addr} is a cloud metadata server's address"
    if (addr.is_loopback or addr.is_unspecified) and not loopback_ok:
        return f"{addr} is this host's own address (name the loopback origin itself to allow it)"
    return None


def names_loopback(host: str) -> bool:
    """Whether an origin's host is loopback by name or literal address (an explicit choice)."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AddressGuard:
    """The check for one origin URL: :meth:`check` before each request, :meth:`address` to
    connect (the host is resolved once; the verdict and the checked addresses are kept)."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.url = url
        self.host = (u.hostname or "").strip("[]")
        try:
            self.port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            self.port = 0
        self.loopback_ok = names_loopback(self.host)
        self._checked = False
        self._refusal: str | None = None
        self._addresses: list[str] = []     # the checked addresses, in the resolver's order
        self.lookups = 0                    # DNS lookups made (one per origin object once resolved)

    async def check(self) -> None:
        """:class:`OriginError` (not worth retrying) when the origin resolves to an address
        it may not be read from; an unresolvable name is left to the request to report."""
        if not self._checked:
            try:
                self._refusal, self._addresses = await self._resolve_and_judge()
            except OSError:
                return      # unresolvable now: the request says so; resolved again next time
            self._checked = True
        if self._refusal is not None:
            raise OriginError(f"origin {self.url[:160]} refused: {self._refusal}")

    async def addresses(self, host: str, port: int) -> list[str]:
        """The checked addresses to connect to for ``host``:``port`` (this origin's own: there
        is no other, redirects are not followed), in the resolver's order. Raises
        :class:`OriginError` for a refused origin or another host, ``OSError`` when the name
        does not resolve now."""
        if host.strip("[]").lower() != self.host.lower() or port != self.port:
            raise OriginError(f"origin {self.url[:160]}: a connection to {host[:80]}:{port} is not this origin's")
        await self.check()
        if not self._checked:
            raise OSError(f"{self.host[:80]} does not resolve")
        return list(self._addresses)

    async def connect(self, host: str, port: int) -> trio.SocketStream:
        """A TCP connection to the first checked address of ``host`` that takes one."""
        last: OSError | None = None
        for addr in await self.addresses(host, port):
            try:
                return await trio.open_tcp_stream(addr, port)
            except OSError as e:
                last = e
        raise last if last is not None else OSError(f"{host[:80]}: no address")

    async def _resolve_and_judge(self) -> tuple[str | None, list[str]]:
        try:
            lit = ipaddress.ip_address(self.host)
        except ValueError:
            pass
        else:
            return address_refusal(lit, loopback_ok=self.loopback_ok), [str(lit)]
        self.lookups += 1
        infos = await trio.socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        addrs: list[str] = []
        for *_, sockaddr in infos:
            try:
                addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            except ValueError:
                return f"{self.host} resolves to {str(sockaddr[0])[:80]!r}, not an address", []
            why = address_refusal(addr, loopback_ok=self.loopback_ok)
            if why is not None:
                return f"{self.host} resolves to {why}", []
            if str(addr) not in addrs:
                addrs.append(str(addr))
        if not addrs:
            raise OSError(f"{self.host[:80]} resolves to no address")
        return None, addrs


class PinnedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's trio backend, connecting to :meth:`AddressGuard.address` instead of
    resolving the host again. httpcore hands TLS the URL's host (``server_hostname``), so SNI
    and the certificate check keep the name; only the TCP connection is pinned."""

    def __init__(self, guard: AddressGuard) -> None:
        self.guard = guard
        self._net = httpcore.TrioBackend()

    # (httpcore's interface names the timeout argument; httpcore passes its connect timeout)
    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        try:
            addrs = await self.guard.addresses(host, port)
        except OSError as e:
            raise httpcore.ConnectError(str(e)) from None
        for addr in addrs[:-1]:
            try:
                return await self._net.connect_tcp(addr, port, timeout=timeout, local_address=local_address,
                                                   socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout):
                continue   # the next checked address
        return await self._net.connect_tcp(addrs[-1], port, timeout=timeout, local_address=local_address,
                                           socket_options=socket_options)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("an origin is never a unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._net.sleep(seconds)
