"""HTTP/1.1 response heads, parsed in one place for our lean clients: the placer's push
pool (:mod:`scheduler_link.fanout`), the herd's peer client (:mod:`p2p.peers`) and its
plain-http origin client (:mod:`p2p.origins.lean`).

Strict and small on purpose: a status line, headers, a ``content-length`` body; a chunked
answer is a protocol error (neither of our servers sends one) unless the caller takes
``chunked_ok`` (the origin client hands such an answer to httpx). Pure: bytes in, a
:class:`ResponseHead` out, or :class:`~infra.errors.ProtocolError` naming what is
wrong; the callers add where it came from and map it to their own error.

The three clients also share the read of a head off a kept-alive connection
(:func:`receive_head`): each gives it its own ``receive`` (a trio stream, a raw socket
under a deadline, TLS) and maps its three outcomes: a connection the peer closed before
answering (:class:`ClosedBeforeAnswer`: a kept-alive connection it had already closed, so
the request is sent again on a fresh one), a close mid-head (:class:`ClosedMidHead`), a
head over the bound (:class:`HeadTooLarge`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple

from .errors import ProtocolError

__all__ = ["ClosedBeforeAnswer", "ClosedMidHead", "HeadTooLarge", "ResponseHead", "parse_response_head",
           "receive_head"]

END_OF_HEAD = b"\r\n\r\n"


class ClosedBeforeAnswer(Exception):
    """The peer closed the connection (EOF or reset) before a byte of the answer came."""


class ClosedMidHead(ProtocolError):
    """The peer closed the connection in the middle of the answer's head."""


class HeadTooLarge(ProtocolError):
    """The answer's head is longer than the caller's bound."""


async def receive_head(receive: Callable[[], Awaitable[bytes | bytearray]], buf: bytearray, *,
                       max_head: int) -> tuple[bytes, bytearray]:
    """Receive into ``buf`` (bytes already received may be in it) until the blank line
    that ends a response head: (the head, the bytes after it: the body's start). ``buf``
    is the caller's and holds what came in when this raises. The caller bounds the wait."""
    start = 0
    while (end := buf.find(END_OF_HEAD, start)) < 0:
        if len(buf) > max_head:
            raise HeadTooLarge(f"answer head over {max_head} bytes")
        start = max(0, len(buf) - 3)   # the blank line may straddle two pieces
        try:
            piece = await receive()
        except ConnectionResetError:
            if not buf:
                raise ClosedBeforeAnswer() from None
            raise
        if not piece:
            if not buf:
                raise ClosedBeforeAnswer()
            raise ClosedMidHead("closed mid-head")
        buf += piece
    return bytes(buf[:end]), buf[end + 4:]


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
