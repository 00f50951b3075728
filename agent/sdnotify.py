"""sd_notify over the socket protocol directly (no libsystemd, no extra package).

``NOTIFY_SOCKET`` names a unix datagram socket; a leading ``@`` means the abstract
namespace (a NUL byte). Outside systemd (no ``NOTIFY_SOCKET``) every call is a no-op.
The watchdog is petted from the trio loop itself (:meth:`Notifier.watchdog`), so a
wedged event loop stops the pets and systemd restarts the agent.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

import trio

log = logging.getLogger("herd.agent.sdnotify")


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        wpid = env.get("WATCHDOG_PID")
        self.watchdog_s: float | None = None
        if usec and usec.isdigit() and int(usec) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6
        self.sent = 0

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: Any) -> bool:
        """Send ``KEY=value`` lines (``ready=1`` -> ``READY=1``); False when not under systemd."""
        if self.address is None:
            return False
        msg = "\n".join(f"{k.upper()}={str(v).replace(chr(10), ' ')}" for k, v in fields.items()).encode()
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(msg, addr)
        except OSError as e:
            log.warning("sd_notify failed socket=%s err=%s", self.address, e)
            return False
        self.sent += 1
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify(ready=1, status=status) if status else self.notify(ready=1)

    def status(self, text: str) -> bool:
        return self.notify(status=text.replace("\n", " "))

    def stopping(self) -> bool:
        return self.notify(stopping=1)

    async def watchdog(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Send WATCHDOG=1 every WATCHDOG_USEC/2 until cancelled (returns at once if not asked)."""
        task_status.started()
        if self.address is None or self.watchdog_s is None:
            return
        while True:
            self.notify(watchdog=1)
            await trio.sleep(self.watchdog_s / 2)
