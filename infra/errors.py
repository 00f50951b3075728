"""The scheduler link's errors, by who broke the rules; every one is a :class:`LinkError`.

Third-party failures (httpx, OSError from sockets, msgspec decode errors) are mapped to
these where they enter this package, so callers (the agent, the placer, the CLI) catch
``LinkError`` or one of its kinds and show one line, never a library's traceback.
"""

from __future__ import annotations


class LinkError(Exception):
    """Base of every error the scheduler link raises."""


class ProtocolError(LinkError):
    """The other side broke the wire protocol (framing, HTTP, a body that does not decode),
    or the connection went away mid-exchange."""


class ClientError(LinkError):
    """A request to a herd service failed (unreachable, refused, or an error answer);
    ``status`` is the HTTP status of an error answer (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class PushError(LinkError):
    """A push that got no HTTP answer (connect refused, reset, deadline)."""


class HTTPError(LinkError):
    """Raised by a route handler: answer with ``status`` and the ``{error, detail}`` body."""

    def __init__(self, status: int, error: str, detail: str | None = None) -> None:
        super().__init__(f"{status} {error}")
        self.status = status
        self.error = error
        self.detail = detail


class AuthError(LinkError):
    """A message's MAC or signature does not verify, or cannot be checked yet
    (scheduler_link.msgauth): nothing in it may be acted on."""


def single_cause(exc: BaseException) -> BaseException:
    """The one exception inside nested one-member exception groups (a daemon's start-up
    failure surfaces from trio's nurseries wrapped so); ``exc`` itself otherwise."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


__all__ = ["AuthError", "ClientError", "HTTPError", "LinkError", "ProtocolError", "PushError", "single_cause"]
