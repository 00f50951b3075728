"""Which origins may a placement make this node read? (DESIGN.md, Security model: origins
allow-listed.)

A placement names the origin its artifact comes from. Without a check, anyone who may
place could make the agent read any ``gs://`` bucket with the node's own credentials (a
confused deputy) or any ``http://`` address inside the network (SSRF). The agent holds a
list of allowed origins; a placement's origin must be one of them or lie under one.

Matching, on the parsed URL: the scheme and the host (and port) must be equal
(case-insensitive), and the path must equal the allowed path or continue it after a
``/`` (``gs://b/team`` allows ``gs://b/team/x``, not ``gs://b/team-other``). A candidate
with user info, a query, a fragment, ``.``/``..`` path segments (also percent-encoded),
control characters or over 2,048 characters is refused whatever the list says. Pure:
no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

MAX_ORIGIN_URL = 2048


def _parts(url: str) -> tuple[str, str, str] | str:
    """(scheme, host[:port], path without trailing '/') or why the URL is unacceptable."""
    if not isinstance(url, str) or not url:
        return "empty origin URL"
    if len(url) > MAX_ORIGIN_URL:
        return f"origin URL over {MAX_ORIGIN_URL} characters"
    if any(ord(c) < 0x21 or ord(c) == 0x7f for c in url):
        return "origin URL with spaces or control characters"
    if url.startswith("/"):
        url = "file://" + url
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        return f"invalid origin URL: {e}"
    if u.username is not None or u.password is not None:
        return "origin URL with user info"
    if u.query or u.fragment or "?" in url or "#" in url:
        return "origin URL with a query or fragment"
    path = unquote(u.path)
    if any(seg in (".", "..") for seg in path.split("/")) or "\\" in path:
        return "origin URL with '.' or '..' path segments"
    host = (u.hostname or "").lower()
    if u.scheme.lower() == "file" and host == "localhost":
        host = ""
    netloc = host if port is None else f"{host}:{port}"
    return u.scheme.lower(), netloc, path.rstrip("/")


def origin_refusal(url: str, allowed: Iterable[str] | None) -> str | None:
    """None when ``url`` may be read, else the reason (one line, names the URL).

    ``allowed`` None: only check that the URL is well-formed (config validation); an agent
    passes its list, empty by default, and an empty list refuses every origin."""
    cand = _parts(url)
    if isinstance(cand, str):
        return f"origin {url[:120]!r} refused: {cand}"
    if allowed is None:
        return None
    scheme, netloc, path = cand
    for entry in allowed:
        ok = _parts(entry)
        if isinstance(ok, str):
            continue
        a_scheme, a_netloc, a_path = ok
        if scheme == a_scheme and netloc == a_netloc and (path == a_path or path.startswith(a_path + "/")):
            return None
    allowed = list(allowed)
    if not allowed:
        return (f"origin {url[:120]!r} refused: this agent allows no origins "
                "(herd agent run --allowed-origin URL, or agent.allowed_origins)")
    return (f"origin {url[:120]!r} is not among this agent's allowed origins "
            "(herd agent run --allowed-origin URL, or agent.allowed_origins)")
