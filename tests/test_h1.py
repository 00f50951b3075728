"""infra.h1: the one HTTP/1.1 response-head parser (the push pool's and the peer
client's)."""

from __future__ import annotations

import pytest

from infra.errors import ProtocolError
from infra.h1 import (
    ClosedBeforeAnswer,
    ClosedMidHead,
    HeadTooLarge,
    ResponseHead,
    parse_response_head,
    receive_head,
)


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


# ---------------------------------------------------------------- receive_head: the clients' shared read


class Pieces:
    """A receive that hands out ``pieces`` in order, then EOF (or raises one given as such)."""

    def __init__(self, *pieces: bytes | BaseException) -> None:
        self.pieces = list(pieces)

    async def __call__(self) -> bytes:
        if not self.pieces:
            return b""
        p = self.pieces.pop(0)
        if isinstance(p, BaseException):
            raise p
        return p


async def test_a_head_split_anywhere_is_found_and_the_body_start_kept() -> None:
    raw = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    body_at = raw.index(b"\r\n\r\n") + 4
    for cut in range(1, len(raw)):
        head, rest = await receive_head(Pieces(raw[:cut], raw[cut:]), bytearray(), max_head=1024)
        assert head == raw[:body_at - 4] and parse_response_head(head).length == 5
        # a first piece holding the whole head is not waited past
        assert rest == (raw[body_at:cut] if cut >= body_at else b"hello")


async def test_bytes_already_received_count_and_only_one_answer_is_read() -> None:
    buf = bytearray(b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200")
    head, rest = await receive_head(Pieces(), buf, max_head=1024)
    assert head == b"HTTP/1.1 204 No Content" and rest == b"HTTP/1.1 200"


@pytest.mark.parametrize("pieces,error", [
    ((), ClosedBeforeAnswer),                                    # EOF at once: a stale kept-alive connection
    ((ConnectionResetError(),), ClosedBeforeAnswer),             # reset at once: the same
    ((b"HTTP/1.1 200 OK\r\n",), ClosedMidHead),                  # EOF mid-head
    ((b"HTTP/1.1 200 OK\r\n", ConnectionResetError()), ConnectionResetError),
    ((b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 40,), HeadTooLarge),
])
async def test_each_way_a_head_can_fail_has_its_own_type(pieces: tuple[bytes | BaseException, ...],
                                                        error: type[BaseException]) -> None:
    with pytest.raises(error):
        await receive_head(Pieces(*pieces), bytearray(), max_head=64)
    assert issubclass(ClosedMidHead, ProtocolError) and issubclass(HeadTooLarge, ProtocolError)
