"""Enrolment certificate checks in worker processes, ahead of the batches that need them.

Why: in a cold registration every member's enrolment by ECDH (a certificate issued without an
enrolment key; keyed enrolments need neither and never come here) costs the placer one CA
signature check and one ECDH (scheduler_link.enroll: ~0.15-0.2 ms of the ~0.5 ms a member costs it), and
cryptography holds the GIL through both, so a thread does not help. Here a relay's batch of
enrolments hands its unchecked certificates to a process pool as soon as the batch arrives,
while it still waits for its turn (placer.relays: batches are worked on one at a time, in
arrival order); by its turn they are checked, and the desk works the batch from its cache
(scheduler_link.enroll.EnrollDesk.learn). The event loop stays free meanwhile.

What crosses to a worker: the CA's certificate, the placer's TLS key and the members'
certificates (DER); back: each certificate's checked fields and ECDH secret, or None (the
desk refuses that one itself, with its outcome, when its enrolment comes up). Nothing is
trusted for being in the cache: the desk checks each enrolment's MAC, validity, deny-list
and nonce as before. A pool that breaks (a worker killed) is dropped and its batches are
checked in the loop, as with no pool.

Invariant: the pool never decides; a batch's answers are the desk's, whatever the pool did.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import trio

from scheduler_link import enroll

log = logging.getLogger("herd.placer.enrollpool")

PARENT_POLL_S = 1.0   # a worker whose placer is gone exits within this (where the kernel does not say at once)
MIN_BATCH = 4         # fewer unchecked certificates than this are checked in the loop (the IPC costs more)
MAX_WORKERS = 4
# Below this many cores the default is no worker: on 2 cores a worker's core is the one everything
# else runs on (the TLS of the relays' connections, the heartbeats, other daemons; on a test host the
# emulated fleet), and a 131,072-node cold registration took 389 s with one against 130 s without.
MIN_CORES = 4


def _worker_start(parent: int) -> None:
    """In each worker, first: exit when the placer that started it is gone, however it went
    (killed, a kill -9 too: a pool's idle workers would wait on their queue for ever). Linux
    says so at once (PR_SET_PDEATHSIG); a thread checks the parent every PARENT_POLL_S anyway."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # (not Linux)
        pass
    if os.getppid() != parent:   # (gone before that took hold)
        os._exit(0)
    threading.Thread(target=_watch_parent, args=(parent,), name="herd-enroll-parent", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def default_workers(cores: int | None = None) -> int:
    """``enroll_workers`` unset: one worker per core but the loop's, at most MAX_WORKERS, and
    none (in the loop) below MIN_CORES. ``cores``: the host's (default: os.cpu_count())."""
    n = (os.cpu_count() or 1) if cores is None else cores
    return 0 if n < MIN_CORES else min(MAX_WORKERS, n - 1)


class Checking:
    """One batch's certificates being checked: ``result()`` once ``wait()`` returned."""

    def __init__(self, ders: list[bytes], fut: concurrent.futures.Future[list[enroll.KnownCert | None]] | None) -> None:
        self.ders = ders
        self._fut = fut
        self._done = trio.Event()
        if fut is None:
            self._done.set()
            return
        token = trio.lowlevel.current_trio_token()
        fut.add_done_callback(lambda _: self._wake(token))

    def _wake(self, token: trio.lowlevel.TrioToken) -> None:
        try:
            token.run_sync_soon(self._done.set)
        except trio.RunFinishedError:
            pass

    async def wait(self) -> None:
        await self._done.wait()

    def result(self) -> list[enroll.KnownCert | None] | None:
        """The checks (None: none were made; the desk checks each in the loop)."""
        if self._fut is None or self._fut.cancelled():
            return None
        try:
            return self._fut.result(timeout=0)
        except (BrokenProcessPool, concurrent.futures.TimeoutError, OSError) as e:
            log.warning("enrolment checks in a worker failed, checking in the loop: %s", e)
            return None


class EnrollPool:
    """The worker processes (spawned when first needed, never forked from the running loop)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._ex: concurrent.futures.ProcessPoolExecutor | None = None
        self._broken = False
        # statistics
        self.batches = 0
        self.certificates = 0

    def warm(self, desk: enroll.EnrollDesk) -> None:
        """Start the workers (a relay asked for the placer's certificate: its members'
        enrolments follow), so that the first batches do not wait for them to start."""
        if self._ex is None and self.workers > 0 and not self._broken:
            self._submit(desk, [])

    def submit(self, desk: enroll.EnrollDesk, ders: list[bytes]) -> Checking:
        """``ders`` handed to a worker now (fewer than MIN_BATCH, or no pool: to no one)."""
        if len(ders) < MIN_BATCH or self.workers <= 0 or self._broken:
            return Checking(ders, None)
        fut = self._submit(desk, ders)
        if fut is None:
            return Checking(ders, None)
        self.batches += 1
        self.certificates += len(ders)
        return Checking(ders, fut)

    def _submit(self, desk: enroll.EnrollDesk, ders: list[bytes]
                ) -> concurrent.futures.Future[list[enroll.KnownCert | None]] | None:
        try:
            if self._ex is None:
                self._ex = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_start, initargs=(os.getpid(),))
            ca, key = desk.pool_args()
            return self._ex.submit(enroll.check_members, ca, key, ders)
        except (BrokenProcessPool, RuntimeError, OSError) as e:
            log.warning("enrolment worker processes unavailable, checking in the loop: %s", e)
            self._broken = True
            return None

    def close(self) -> None:
        ex, self._ex = self._ex, None
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)

    def statistics(self) -> dict[str, int]:
        return {"workers": self.workers if not self._broken else 0, "started": int(self._ex is not None),
                "batches": self.batches, "certificates": self.certificates}
