"""infra.h1: the one HTTP/1.1 response-head parser (the push pool's and the peer
client's)."""

from __future__ import annotations

import pytest

from infra.errors import ProtocolError
from infra.h1 import ResponseHead, parse_response_head


@pytest.mark.parametrize(("head", "want"), [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2", ResponseHead(200, 2, True)),
    (b"HTTP/1.1 204 No Content", ResponseHead(204, None, True)),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0", ResponseHead(200, 0, False)),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 1", ResponseHead(200, 1, False)),
    (b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1", ResponseHead(200, 1, True)),
    (b"HTTP/1.1 503 Busy\r\nretry-after: 1\r\ncontent-length: 5", ResponseHead(503, 5, True)),
])
def test_heads(head: bytes, want: ResponseHead) -> None:
    assert parse_response_head(head) == want


@pytest.mark.parametrize(("head", "why"), [
    (b"garbage", "bad status line"),
    (b"HTTP/2 200", "bad status line"),
    (b"HTTP/1.1 abc OK", "bad status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here", "malformed header"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: -1", "bad content-length"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked", "chunked"),
])
def test_refusals_name_the_cause(head: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        parse_response_head(head)
