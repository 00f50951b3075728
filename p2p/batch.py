"""Multi-chunk requests on the data plane: one request names up to N chunks, the answer
streams them back to back, each behind a small frame header.

    GET /v1/chunks?ids=<64-hex>,<64-hex>,...

The answer (200, ``application/x-herd-chunks``, Content-Length framed) is one frame per
requested id, in the request's order: a 16-byte header (:data:`FRAME`: magic ``HCK1``,
a status byte, three zero bytes, the body's size as a big-endian u64) followed by the
body when the status is :data:`OK`. :data:`MISSING` (the chunk is not here) and
:data:`BUSY` (the chunk is being sent to ``max_serving_per_chunk`` peers already) carry
no body: the asker fetches those elsewhere, the rest of the batch is kept. A batch where
no chunk is here is a 404; one where none can be sent and some are busy a 503 with
Retry-After, as for one chunk. Hostile requests (no ids, more than the server's
``max_batch_chunks``, a malformed or repeated id, a batch over ``max_batch_bytes``) get a
4xx naming why and cost nothing else.

A batch that can wait (``GET /v1/chunks?ids=a,b&sizes=Na,Nb&wait_ms=W``, what a tree
child asks its parent: the next chunks the parent is itself fetching) names each chunk's
size, as the asker's manifest says (the server may not hold them yet, and the answer is
Content-Length framed): every frame is then :data:`OK` with that many bytes, sent in
order as each chunk arrives at the server (and, over the server's per-chunk cap, once a
copy of it finished), within ``W`` ms of the request. A chunk still absent at the
deadline, or of another size, ends the answer early (the connection is closed after the frames sent): the asker keeps what came
and fetches the rest elsewhere, as for a peer that died mid-batch. The first chunk absent
after the whole wait: 404, like one chunk.

Why a frame per chunk rather than one answer per request: the per-request cost of
HTTP (a head each way, a wakeup, a serving slot, a task switch per chunk on both ends)
was most of the herd's CPU per GiB beyond the minimal loop (``python -m bench.node``).

This module holds what both ends share: the frame, the query's parsing, and the two
blocking loops that run in worker threads on plain connections (:func:`send_frames`:
header with ``MSG_MORE`` then ``sendfile``, per chunk; :func:`receive_frames`:
``readv`` straight into each chunk's buffer, BLAKE3 as the bytes land, the verified chunk
stored by the same thread). Both work on their own duplicate of the socket's descriptor
and own the file descriptors handed to them, so a cancelled caller can abandon them:
they notice ``stop`` (a :class:`Stop`: at once) and close what they hold.
"""

from __future__ import annotations

import os
import re
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import blake3

FRAME = struct.Struct(">4sB3xQ")
MAGIC = b"HCK1"
OK, MISSING, BUSY = 0, 1, 2
CONTENT_TYPE = "application/x-herd-chunks"
# How often a worker thread blocked on its socket looks whether it was stopped: ~every
# waiting batch has a receiving thread in a gap wait on the child and a sending one on
# the parent (2 a peer pair and direction), so at 16 nodes ~60 a node, 960 in all, each
# waking POLL_S apart while idle (0.05 s: ~19,000 idle wakeups a second on two cores).
# An abandoned thread closes what it holds at most this long after it was stopped.
POLL_S = 0.2

T = TypeVar("T")


class Stop:
    """What a worker thread is told to stop by: a ``threading.Event`` (``set``,
    ``is_set``) that is also a descriptor (an eventfd) the thread polls beside its
    socket, so a thread waiting for bytes wakes when they come, when its deadline
    passes or when it is stopped -- never just to look (with a bare Event it looks
    every ``POLL_S``: at 16 nodes in the namespace bench ~60 idle waiting-batch threads a
    node, ~4,800 wakeups a second on two cores, each taking the GIL). The descriptor
    is closed when the last holder lets go of this object."""
    __slots__ = ("_event", "_fd")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    def set(self) -> None:
        self._event.set()
        try:
            os.eventfd_write(self._fd, 1)
        except OSError:   # pragma: no cover  (the counter cannot overflow at one write per set)
            pass

    def is_set(self) -> bool:
        return self._event.is_set()

    def fileno(self) -> int:
        return self._fd

    def __del__(self) -> None:
        try:
            os.close(self._fd)
        except (OSError, AttributeError):   # pragma: no cover
            pass


StopLike = threading.Event | Stop


def watch(poller: select.poll, stop: StopLike) -> bool:
    """Register ``stop``'s descriptor with ``poller`` (a :class:`Stop`): True; a bare
    Event has none: False (the caller then looks every ``POLL_S``)."""
    if isinstance(stop, Stop):
        poller.register(stop.fileno(), select.POLLIN)
        return True
    return False


def poll_ms(watched: bool, left_s: float) -> int:
    """How long one poll may sleep: until the deadline ``left_s`` away when the stop is
    watched, else at most ``POLL_S``."""
    left = max(left_s, 0.0) if watched else min(max(left_s, 0.0), POLL_S)
    return max(1, min(int(left * 1000) + 1, 600_000))

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class BatchQueryError(ValueError):
    """A batch request the server refuses: ``status`` (400 or 413) and why."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(f"{error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail


def parse_ids(query: str, max_chunks: int) -> list[str]:
    """The ids of ``ids=a,b,c`` (the whole query), or :class:`BatchQueryError`.
    Work is bounded by ``max_chunks`` before any id is looked at."""
    key, eq, value = query.partition("=")
    if key != "ids" or not eq or "&" in value:
        raise BatchQueryError(400, "bad batch", "the query must be ids=<id>,<id>,... and nothing else")
    if not value:
        raise BatchQueryError(400, "bad batch", "no ids")
    ids = value.split(",", max_chunks)
    if len(ids) > max_chunks:
        raise BatchQueryError(413, "too many chunks", f"at most {max_chunks} ids a request")
    seen: set[str] = set()
    for i, cid in enumerate(ids):
        if not _HEX64.match(cid):
            raise BatchQueryError(400, "bad id", f"id #{i}: ids are 64 lower-case hex characters")
        if cid in seen:
            raise BatchQueryError(400, "duplicate id", f"id #{i} ({cid[:16]}) is named twice")
        seen.add(cid)
    return ids


def query_of(ids: Sequence[str], sizes: Sequence[int] | None = None, wait_ms: int = 0) -> str:
    """The query of a batch; with ``wait_ms`` > 0 a batch that can wait (``sizes`` required)."""
    q = "ids=" + ",".join(ids)
    if wait_ms > 0:
        assert sizes is not None and len(sizes) == len(ids)
        q += "&sizes=" + ",".join(str(int(n)) for n in sizes) + f"&wait_ms={int(wait_ms)}"
    return q


@dataclass(frozen=True, slots=True)
class BatchQuery:
    ids: list[str]
    sizes: list[int] | None = None     # a batch that can wait: each chunk's size (the asker's manifest)
    wait_ms: int = 0


def parse_batch(query: str, max_chunks: int, max_wait_ms: int) -> BatchQuery:
    """``ids=...`` (:func:`parse_ids`), or ``ids=...&sizes=...&wait_ms=N`` (a batch that can
    wait: as many sizes as ids, each a decimal byte count; ``wait_ms`` capped at
    ``max_wait_ms``), or :class:`BatchQueryError`. Nothing else is accepted."""
    if "&" not in query:
        return BatchQuery(parse_ids(query, max_chunks))
    parts = query.split("&", 3)
    if len(parts) != 3 or not parts[1].startswith("sizes=") or not parts[2].startswith("wait_ms="):
        raise BatchQueryError(400, "bad batch", "the query must be ids=<id>,... or ids=...&sizes=<n>,...&wait_ms=<ms>")
    ids = parse_ids(parts[0], max_chunks)
    raw = parts[1][len("sizes="):].split(",", len(ids))
    if len(raw) != len(ids) or not all(x.isdigit() and len(x) <= 12 for x in raw):
        raise BatchQueryError(400, "bad sizes", f"one decimal byte count per id ({len(ids)})")
    wait = parts[2][len("wait_ms="):]
    if not wait.isdigit() or len(wait) > 12:
        raise BatchQueryError(400, "bad wait_ms", "a non-negative integer of milliseconds")
    return BatchQuery(ids, [int(x) for x in raw], min(int(wait), max_wait_ms))


def frame(status: int, size: int) -> bytes:
    return FRAME.pack(MAGIC, status, size)


class Handoff:
    """Who owns the descriptors given to a worker-thread job: the job once it started
    (it closes them, even when its caller was cancelled and abandoned it), the caller
    when it never started (cancelled while waiting for a thread). :meth:`keep` (the
    caller, after the job returned or was abandoned): True when they are still the
    caller's to close; the job will then never start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner = "caller"

    def run(self, job: Callable[[], T]) -> T | str:
        with self._lock:
            if self._owner != "caller":
                return "stopped"
            self._owner = "job"
        return job()

    def keep(self) -> bool:
        with self._lock:
            if self._owner == "caller":
                self._owner = "gone"
                return True
            return False


# ------------------------------------------------------------------------------ sending (server)

@dataclass(slots=True)
class Outgoing:
    """One frame to send: the header, and the chunk file's path and size ("" and 0 for a
    frame without a body). The file is opened only while its frame is being sent (``fd``),
    so a batch holds one chunk file open at a time however many it names."""
    header: bytes
    path: str = ""
    size: int = 0
    fd: int = -1

    def open(self) -> str:
        """Open the chunk file for sending: "" or why not (the frame cannot be sent: the
        answer's framing is then broken, the connection must be dropped)."""
        if not self.path or self.fd >= 0:
            return ""
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return "chunk evicted while its batch was being sent"
        if os.fstat(self.fd).st_size != self.size:
            return "chunk file changed size while its batch was being sent"
        return ""

    def done(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def send_frames(sock_fd: int, frames: list[Outgoing], stall_s: float, stop: StopLike) -> str:
    """Worker thread: send every frame on the non-blocking socket ``sock_fd`` (a
    duplicate this function closes; each frame's file is opened while it is sent): the header
    with ``MSG_MORE``, the body by ``sendfile`` (pread + send where the file system
    cannot). Returns "" when all was sent, else why not ("stall", "stopped", an error's
    text): the connection must then be dropped, its framing is broken."""
    sock = socket.socket(fileno=sock_fd)
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    watched = watch(poller, stop)

    def wait() -> str:
        deadline = time.monotonic() + stall_s
        while True:
            if stop.is_set():
                return "stopped"
            if poller.poll(poll_ms(watched, deadline - time.monotonic())):
                return "stopped" if stop.is_set() else ""
            if time.monotonic() >= deadline:
                return "stall"

    try:
        for f in frames:
            if why := f.open():
                return why
            view = memoryview(f.header)
            while view:
                try:
                    view = view[sock.send(view, socket.MSG_MORE if f.size else 0):]
                except BlockingIOError:
                    if why := wait():
                        return why
            off = 0
            while off < f.size:
                try:
                    n = os.sendfile(sock_fd, f.fd, off, f.size - off)
                except BlockingIOError:
                    if why := wait():
                        return why
                    continue
                except OSError as e:
                    if e.errno not in (22, 38, 95):   # EINVAL, ENOSYS, EOPNOTSUPP: no sendfile here
                        raise
                    data = os.pread(f.fd, min(1 << 20, f.size - off), off)
                    if not data:
                        return "chunk file truncated while sending"
                    rest = memoryview(data)
                    while rest:
                        try:
                            rest = rest[sock.send(rest):]
                        except BlockingIOError:
                            if why := wait():
                                return why
                    n = len(data)
                if n == 0:
                    return "chunk file truncated while sending"
                off += n
            f.done()
        return ""
    except OSError as e:
        return e.strerror or str(e)
    finally:
        for f in frames:
            f.done()
        sock.close()


Session = tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]


def tls_session(stream: object) -> Session | None:
    """The TLS session objects inside a ``trio.SSLStream`` (its SSLObject and memory
    BIOs: private attributes of trio), for a worker thread to encrypt or decrypt with
    while the stream's owner leaves the stream alone; None where they are not found as
    expected (another trio: the caller then goes through the stream on the trio thread)."""
    obj, inc, out = (getattr(stream, a, None) for a in ("_ssl_object", "_incoming", "_outgoing"))
    if isinstance(obj, ssl.SSLObject) and isinstance(inc, ssl.MemoryBIO) and isinstance(out, ssl.MemoryBIO):
        return obj, inc, out
    return None


def send_frames_tls(sock_fd: int, session: Session, frames: list[Outgoing], stall_s: float,
                    stop: StopLike, piece: int = 256 * 1024) -> str:
    """:func:`send_frames` through an established TLS session (see :func:`tls_session`):
    each frame's header and body (pread in ``piece``-sized reads) encrypted into the
    session's outgoing BIO and sent from there. Owns ``sock_fd`` (a duplicate), like
    :func:`send_frames`."""
    sock = socket.socket(fileno=sock_fd)
    obj, _, out = session
    poller = select.poll()
    poller.register(sock_fd, select.POLLOUT)
    watched = watch(poller, stop)

    def push(data: bytes | memoryview) -> str:
        obj.write(data)
        wire = memoryview(out.read())
        deadline = time.monotonic() + stall_s
        while wire:
            try:
                wire = wire[sock.send(wire):]
                deadline = time.monotonic() + stall_s
            except BlockingIOError:
                while not poller.poll(poll_ms(watched, deadline - time.monotonic())):
                    if stop.is_set():
                        return "stopped"
                    if time.monotonic() >= deadline:
                        return "stall"
                if stop.is_set():
                    return "stopped"
        return ""

    try:
        for f in frames:
            if (why := f.open()) or (why := push(f.header)):
                return why
            off = 0
            while off < f.size:
                data = os.pread(f.fd, min(piece, f.size - off), off)
                if not data:
                    return "chunk file truncated while sending"
                if why := push(data):
                    return why
                off += len(data)
            f.done()
        return ""
    except (OSError, ssl.SSLError) as e:
        return getattr(e, "strerror", None) or str(e)
    finally:
        for f in frames:
            f.done()
        sock.close()


# ------------------------------------------------------------------------------ receiving (client)

@dataclass(slots=True)
class Received:
    """What a batch's receive came to: per requested chunk, in order, "ok" (verified and
    stored), "missing", "busy", "corrupt" (bytes did not hash to the id: refused), or
    absent from ``outcomes`` (not received: ``error`` says why). ``nbytes``: body bytes
    received; ``consumed``: body-stream bytes read (frames included)."""
    outcomes: list[str] = field(default_factory=list)
    error: str = ""
    kind: str = ""           # "stall", "closed", "reset", "protocol", "stopped", "store"
    store_error: BaseException | None = None
    nbytes: int = 0
    consumed: int = 0


class _Cut(Exception):
    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind = kind


class FrameReader:
    """Blocking reads of exact lengths: ``prefix`` bytes first (what arrived with the
    answer's head, or a whole answer received elsewhere), then from the non-blocking
    socket ``fd`` (poll + ``readv``; a duplicate this reader closes). ``fd`` < 0: the
    prefix is all there is; reading past it is a cut of kind ``end[0]`` (why: ``end[1]``)."""

    def __init__(self, fd: int, prefix: bytes | bytearray | memoryview, stall_s: float = 0.0,
                 stop: StopLike | None = None, lowat_max: int = 128 * 1024,
                 end: tuple[str, str] = ("closed", "the answer ended"), gap_s: float = 0.0) -> None:
        self.prefix = memoryview(prefix)
        self.stall_s = stall_s
        # a batch that can wait: how long a frame's header may take to start coming (the
        # server sends each chunk when it has it); within a frame, stall_s
        self.gap_s = max(gap_s, stall_s)
        self.stop = stop or threading.Event()
        self.lowat_max = lowat_max
        self.lowat = 1
        self.end = end
        self.sock: socket.socket | None = None
        self.watched = False
        if fd >= 0:
            self.sock = socket.socket(fileno=fd)
            self.poller = select.poll()
            self.poller.register(fd, select.POLLIN | select.POLLPRI)
            self.watched = watch(self.poller, self.stop)

    def _from_prefix(self, view: memoryview, n: int, hasher: blake3.blake3 | None) -> int:
        """Fill the start of ``view`` (at most ``n``) from the bytes already here; how many."""
        if not self.prefix:
            return 0
        k = min(len(self.prefix), n)
        view[:k] = self.prefix[:k]
        self.prefix = self.prefix[k:]
        if hasher is not None and k:
            hasher.update(view[:k])
        return k

    def fill(self, view: memoryview, n: int, hasher: blake3.blake3 | None = None, *, gap: bool = False) -> None:
        """Exactly ``n`` bytes into ``view``. ``gap``: a frame's start (it may wait ``gap_s``)."""
        got = self._from_prefix(view, n, hasher)
        if got < n and self.sock is None:
            raise _Cut(*self.end)
        last = time.monotonic()
        fd = self.sock.fileno() if self.sock is not None else -1
        while got < n:
            if self.stop.is_set():
                raise _Cut("stopped", "stopped")
            want = min(n - got, self.lowat_max)
            try:
                if want != self.lowat:
                    assert self.sock is not None
                    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    self.lowat = want
                limit = self.gap_s if gap and got == 0 else self.stall_s
                if not self.poller.poll(poll_ms(self.watched, limit - (time.monotonic() - last))):
                    if time.monotonic() - last >= limit:
                        raise _Cut("stall", f"stalled after {got} of {n} bytes")
                    continue
                k = os.readv(fd, [view[got:n]])
            except BlockingIOError:
                continue
            except OSError as e:
                raise _Cut("reset", e.strerror or str(e)) from None
            if k == 0:
                raise _Cut("closed", f"closed after {got} of {n} bytes")
            if hasher is not None:
                hasher.update(view[got:got + k])
            got += k
            last = time.monotonic()

    def close(self) -> None:
        if self.sock is None:
            return
        if self.lowat != 1:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass
        self.sock.close()
        self.sock = None


class TLSFrameReader(FrameReader):
    """:class:`FrameReader` through an established TLS session: the encrypted bytes
    read from the socket (``fd``, a duplicate this reader closes) into the session's
    incoming memory BIO, the plaintext decrypted by ``SSLObject.read`` straight into the
    chunk's buffer (OpenSSL releases the GIL), anything the session must answer (a key
    update) written back from the outgoing BIO. The session's objects are borrowed from
    a ``trio.SSLStream`` whose owner does not touch it meanwhile (see
    ``PeerClient._frames_in_thread``); afterwards it goes on from where this left it."""

    def __init__(self, fd: int, session: tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO],
                 prefix: bytes | bytearray | memoryview, stall_s: float, stop: StopLike,
                 read_size: int = 256 * 1024, gap_s: float = 0.0) -> None:
        super().__init__(fd, prefix, stall_s, stop, gap_s=gap_s)
        self.ssl_obj, self.incoming, self.outgoing = session
        self.read_size = read_size

    def _flush(self) -> None:
        assert self.sock is not None
        data = memoryview(self.outgoing.read())
        deadline = time.monotonic() + self.stall_s
        while data:
            try:
                data = data[self.sock.send(data):]
            except BlockingIOError:
                if time.monotonic() >= deadline or self.stop.is_set():
                    raise _Cut("stall", "could not answer the TLS session") from None
                select.select([], [self.sock], [], POLL_S)

    def fill(self, view: memoryview, n: int, hasher: blake3.blake3 | None = None, *, gap: bool = False) -> None:
        got = self._from_prefix(view, n, hasher)
        assert self.sock is not None
        fd = self.sock.fileno()
        last = time.monotonic()
        while got < n:
            if self.stop.is_set():
                raise _Cut("stopped", "stopped")
            try:
                k = int(self.ssl_obj.read(n - got, view[got:n]))
            except ssl.SSLWantReadError:
                try:
                    if self.outgoing.pending:
                        self._flush()
                    limit = self.gap_s if gap and got == 0 else self.stall_s
                    if not self.poller.poll(poll_ms(self.watched, limit - (time.monotonic() - last))):
                        if time.monotonic() - last >= limit:
                            raise _Cut("stall", f"stalled after {got} of {n} bytes") from None
                        continue
                    data = os.read(fd, self.read_size)
                except BlockingIOError:
                    continue
                except OSError as e:
                    raise _Cut("reset", e.strerror or str(e)) from None
                if not data:
                    raise _Cut("closed", f"closed after {got} of {n} bytes") from None
                self.incoming.write(data)
                last = time.monotonic()
                continue
            except (ssl.SSLError, OSError) as e:
                raise _Cut("reset", f"TLS: {e}") from None
            if k == 0:
                raise _Cut("closed", f"closed after {got} of {n} bytes")
            if hasher is not None:
                hasher.update(view[got:got + k])
            got += k
        if self.outgoing.pending:
            self._flush()


class BufferPool:
    """Receive buffers shared by every receiving thread of the process: taken for one
    chunk, given back after it is stored. A fresh buffer costs its zeroing and a page
    fault per 4 KiB (in the namespace bench ~5 % of all CPU went to ``memset`` page
    faults of per-thread buffers: worker threads come and go, and each grew its own as
    larger chunks came). Sizes are rounded up to a power of two (at least ``floor``)
    so a buffer fits the next chunks too; at most ``keep`` free buffers are held."""

    def __init__(self, floor: int = 1 << 20, keep: int = 8) -> None:
        self._lock = threading.Lock()
        self._free: list[bytearray] = []
        self.floor, self.keep = floor, keep
        self.allocated = 0          # buffers made (for tests and statistics)

    def take(self, n: int) -> bytearray:
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                if len(self._free[i]) >= n:
                    return self._free.pop(i)
            self.allocated += 1
        return bytearray(max(self.floor, 1 << max(n - 1, 1).bit_length()))

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)
            elif self._free and len(buf) > min(len(b) for b in self._free):
                self._free.remove(min(self._free, key=len))   # keep the larger ones
                self._free.append(buf)


BUFFERS = BufferPool()


def receive_frames(reader: FrameReader, items: Sequence[tuple[str, int]], length: int,
                   store: Callable[[str, memoryview], object]) -> Received:
    """Receive the frames of a ``length``-byte batch answer for ``items`` ((id, size), in
    the request's order): each body straight into this thread's buffer, hashed as it
    lands, ``store(id, body)`` called (in this thread) only when it hashes to its id;
    ``body`` is a view of a buffer reused for the next chunk: ``store`` must be done with
    it when it returns (``ChunkStore.put_chunk`` is: it writes it out). A frame
    that is malformed, or announces another size than the manifest's, ends the receive
    (``kind`` "protocol"): its framing cannot be trusted. Runs in a worker thread (plain
    connections) or, through the same reader interface, anywhere."""
    out = Received()
    hdr = bytearray(FRAME.size)
    hview = memoryview(hdr)
    try:
        for cid, size in items:
            if out.consumed + FRAME.size > length:
                raise _Cut("protocol", f"answer of {length} bytes ends before chunk {cid[:16]}'s frame")
            reader.fill(hview, FRAME.size, gap=True)
            out.consumed += FRAME.size
            magic, status, n = FRAME.unpack(hdr)
            if magic != MAGIC:
                raise _Cut("protocol", f"bad frame magic {bytes(magic)!r} for chunk {cid[:16]}")
            if status == OK:
                if n != size:
                    raise _Cut("protocol", f"frame announces {n} bytes for chunk {cid[:16]}, expected {size}")
                if out.consumed + n > length:
                    raise _Cut("protocol", f"frame for chunk {cid[:16]} runs past the answer's end")
                buf = BUFFERS.take(n)
                view = memoryview(buf)[:n]
                try:
                    hasher = blake3.blake3()
                    reader.fill(view, n, hasher)
                    out.consumed += n
                    out.nbytes += n
                    if hasher.hexdigest() != cid:
                        out.outcomes.append("corrupt")
                        continue
                    try:
                        store(cid, view)
                    except Exception as e:   # a full store, a broken disk: the caller raises it
                        out.store_error = e
                        raise _Cut("store", str(e)) from None
                finally:
                    view.release()
                    BUFFERS.give(buf)
                out.outcomes.append("ok")
            elif status in (MISSING, BUSY):
                if n != 0:
                    raise _Cut("protocol", f"a {'missing' if status == MISSING else 'busy'} frame with a body")
                out.outcomes.append("missing" if status == MISSING else "busy")
            else:
                raise _Cut("protocol", f"unknown frame status {status} for chunk {cid[:16]}")
        if out.consumed != length:
            raise _Cut("protocol", f"answer announced {length} bytes, frames took {out.consumed}")
    except _Cut as c:
        out.error = str(c)
        out.kind = c.kind
    finally:
        reader.close()
    return out
