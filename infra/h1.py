"""HTTP/1.1 response heads, parsed in one place for our lean clients: the placer's push
pool (:mod:`scheduler_link.fanout`), the herd's peer client (:mod:`p2p.peers`) and its
plain-http origin client (:mod:`p2p.origins.lean`).

Strict and small on purpose: a status line, headers, a ``content-length`` body; a chunked
answer is a protocol error (neither of our servers sends one) unless the caller takes
``chunked_ok`` (the origin client hands such an answer to httpx). Pure: bytes in, a
:class:`ResponseHead` out, or :class:`~infra.errors.ProtocolError` naming what is
wrong; the callers add where it came from and map it to their own error.
"""

from __future__ import annotations

from typing import NamedTuple

from .errors import ProtocolError

__all__ = ["ResponseHead", "parse_response_head"]


class ResponseHead(NamedTuple):
    status: int
    length: int | None      # content-length; None when absent
    keep_alive: bool        # the connection may carry the next request
    chunked: bool = False   # a transfer-encoding was named (only with chunked_ok)
    coding: bytes = b""     # the content-encoding named, lowercased (b"": none)


def parse_response_head(head: bytes, *, chunked_ok: bool = False) -> ResponseHead:
    """Parse ``head`` (everything before the blank line)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"bad status line (not an HTTP/1.x answer): {lines[0][:60]!r}")
    status = int(parts[1])
    length: int | None = None
    keep = parts[0] == b"HTTP/1.1"
    chunked = False
    coding = b""
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ProtocolError("malformed header line")
        name = name.strip().lower()
        value = value.strip()
        if name == b"content-length":
            if not value.isdigit():
                raise ProtocolError(f"bad content-length {value[:20]!r}")
            length = int(value)
        elif name == b"connection":
            keep = value.lower() == b"keep-alive" or (keep and value.lower() != b"close")
        elif name == b"transfer-encoding":
            if not chunked_ok:
                raise ProtocolError("chunked (transfer-encoding) answers are not supported")
            chunked = True
        elif name == b"content-encoding":
            coding = value.lower()
    return ResponseHead(status, length, keep, chunked, coding)
