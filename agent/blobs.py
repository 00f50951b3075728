"""The agent's gang-blob cache: verified blobs by id, a bounded few, one fetch per id at once.

A gang blob (DESIGN.md, Fleet scale) is fetched by every node of a gang once: a relay
gets it from its bundle, another relay or the placer; a member from its relay, else the
placer. Whoever fetched it keeps it here, so the supervisor's peers-file step, the parts
acceptor and the relay's ``blob_get`` answers read the same bytes.

Invariants:
- only bytes that hash to their id and decode as a canonical blob are kept
  (:func:`~scheduler_link.messages.decode_gang_blob`); a source that gives anything else
  is passed over (counted in ``refused``) and the next source asked;
- at most ``keep`` blobs (the most recently used);
- one fetch per id at a time: concurrent callers wait for the one in flight, then read
  the cache (and fetch themselves only if that one failed).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import trio

from p2p.flight import SingleFlight
from scheduler_link.messages import GangBlob, decode_gang_blob

log = logging.getLogger("herd.agent.blobs")

# blob_id -> the blob's bytes, or None when this source does not have it. May raise
# (OSError, a protocol error, an AgentError): the cache then asks the next source.
BlobSource = Callable[[str], Awaitable[bytes | None]]


class BlobUnavailable(Exception):
    """No source gave a blob that matches its id."""


class BlobCache:
    def __init__(self, keep: int = 8, *, on_blob: Callable[[GangBlob], None] | None = None) -> None:
        """``on_blob``: called with each blob newly kept (the agent takes its read grant)."""
        self.keep = keep
        self._on_blob = on_blob
        self._blobs: OrderedDict[str, tuple[bytes, GangBlob]] = OrderedDict()
        self._flight = SingleFlight()    # one fetch per id at a time
        self._news = trio.Event()        # set whenever a blob is kept or a fetch begins
        self.hits = 0
        self.fetches = 0
        self.refused = 0
        self.failures = 0

    def statistics(self) -> dict[str, int]:
        return {"blobs": len(self._blobs), "hits": self.hits, "fetches": self.fetches, "refused": self.refused,
                "failures": self.failures}

    def put(self, blob_id: str, raw: bytes) -> GangBlob | None:
        """Keep ``raw`` if it is the blob ``blob_id`` (else None: refused, not kept)."""
        got = self._take(blob_id, raw)
        return got if isinstance(got, GangBlob) else None

    def _take(self, blob_id: str, raw: bytes) -> GangBlob | str:
        """:meth:`put`, with why it was refused (a string) instead of None."""
        have = self._blobs.get(blob_id)
        if have is not None:
            self._blobs.move_to_end(blob_id)
            return have[1]
        try:
            blob = decode_gang_blob(raw, blob_id)
        except Exception as e:  # a wrong id, a corrupt or non-canonical blob, a version not read here
            self.refused += 1
            log.warning("gang blob refused blob=%s err=%s", blob_id[:16], e)
            return str(e)
        self._blobs[blob_id] = (raw, blob)
        while len(self._blobs) > self.keep:
            self._blobs.popitem(last=False)
        self._wake()
        if self._on_blob is not None:
            self._on_blob(blob)
        return blob

    def _wake(self) -> None:
        self._news.set()
        self._news = trio.Event()

    def cached(self, blob_id: str) -> tuple[bytes, GangBlob] | None:
        got = self._blobs.get(blob_id)
        if got is not None:
            self._blobs.move_to_end(blob_id)
        return got

    async def wait_cached(self, blob_id: str, timeout_s: float = 0.0) -> tuple[bytes, GangBlob] | None:
        """What is cached, after the fetch in flight for it (if any) ended; never fetches.
        With ``timeout_s``, a blob neither here nor on its way yet is waited for that long
        (the bundle that names it may still be on its way to this node)."""
        with trio.move_on_after(timeout_s):
            while True:
                got = self.cached(blob_id)
                if got is not None:
                    return got
                if await self._flight.wait(blob_id):
                    return self.cached(blob_id)
                if timeout_s <= 0:
                    return None
                await self._news.wait()
        return self.cached(blob_id)

    async def get(self, blob_id: str, sources: Sequence[BlobSource]) -> tuple[bytes, GangBlob]:
        """The blob (bytes, decoded), from the cache or the first source that has it."""
        while True:
            got = self.cached(blob_id)
            if got is not None:
                self.hits += 1
                return got
            # waits for a fetch in flight, then the cache again; if that fetch failed, one waiter tries itself
            fetched = await self._flight.run(blob_id, lambda: blob_id in self._blobs,
                                             partial(self._fetch, blob_id, sources))
            if fetched is not None:
                return fetched

    async def _fetch(self, blob_id: str, sources: Sequence[BlobSource]) -> tuple[bytes, GangBlob]:
        self._wake()   # a fetch begins: wait_cached's waiters now wait for it
        self.fetches += 1
        why = "no source"
        for src in sources:
            try:
                raw = await src(blob_id)
            except Exception as e:  # one source's failure: the next one
                why = f"{type(e).__name__}: {e}"
                log.debug("gang blob source failed blob=%s err=%s", blob_id[:16], why)
                continue
            if raw is None:
                continue
            blob = self._take(blob_id, raw)
            if isinstance(blob, GangBlob):
                return raw, blob
            why = f"a source's blob was refused: {blob}"   # (its version, say: the failed pods name it)
        self.failures += 1
        raise BlobUnavailable(f"gang blob {blob_id[:16]} unavailable ({why})")
