"""Which addresses an ``http(s)://`` origin may be read from.

An origin URL comes from a placement (checked against the agent's allow-list,
:mod:`p2p.origins.allow`), but the allow-list names hosts, and a host name resolves to
whatever its DNS says: an allowed mirror's name pointed at ``169.254.169.254`` (a cloud's
metadata server) or at ``127.0.0.1`` (the agent's own APIs) would make every agent a
server-side request forger. So, before a request leaves:

* a link-local address (``169.254.0.0/16``, ``fe80::/10``, also IPv4-mapped) is refused always;
* a loopback or unspecified address is refused unless the origin names loopback itself
  (``127.0.0.1``, ``[::1]``, ``localhost``): such a URL passed the allow-list only because the
  operator wrote that loopback origin there (tests and single-host set-ups run origins on
  loopback that way).

Redirects are not followed at all (:mod:`p2p.origins.transport`), so an allowed origin cannot
bounce a request elsewhere. The check resolves the host once per origin object; a name whose
DNS answer changes between that check and the connection (rebinding) is not caught here.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import trio

from ..errors import OriginError

_LOOPBACK_NAMES = frozenset({"localhost", "localhost."})
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_refusal(addr: IPAddress, *, loopback_ok: bool) -> str | None:
    """Why an origin may not be read at ``addr``, or None. Pure."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_link_local:
        return f"{addr} is a link-local address (a metadata server's range)"
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
    """The check for one origin URL: :meth:`check` before each request (the host is
    resolved once; the verdict is kept)."""

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

    async def check(self) -> None:
        """:class:`OriginError` (not worth retrying) when the origin resolves to an address
        it may not be read from; an unresolvable name is left to the request to report."""
        if not self._checked:
            try:
                self._refusal = await self._resolve_and_judge()
            except OSError:
                return      # unresolvable now: the request says so; resolved again next time
            self._checked = True
        if self._refusal is not None:
            raise OriginError(f"origin {self.url[:160]} refused: {self._refusal}")

    async def _resolve_and_judge(self) -> str | None:
        try:
            return address_refusal(ipaddress.ip_address(self.host), loopback_ok=self.loopback_ok)
        except ValueError:
            pass
        infos = await trio.socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        for *_, sockaddr in infos:
            try:
                addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            except ValueError:
                continue
            why = address_refusal(addr, loopback_ok=self.loopback_ok)
            if why is not None:
                return f"{self.host} resolves to {why}"
        return None
