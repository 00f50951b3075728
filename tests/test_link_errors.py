"""infra.errors: one base for the package's errors; the modules that raise them
re-export the same classes."""

from __future__ import annotations

import inspect

from infra import errors, http
from scheduler_link import client, fanout


def test_every_error_is_a_link_error_and_the_modules_share_the_classes() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    helpers = {n for n in errors.__all__ if inspect.isfunction(getattr(errors, n))}   # (single_cause)
    assert {c.__name__ for c in classes} == set(errors.__all__) - helpers
    assert all(issubclass(c, errors.LinkError) for c in classes)
    assert client.ClientError is errors.ClientError and fanout.PushError is errors.PushError
    assert http.HTTPError is errors.HTTPError


def test_client_error_keeps_the_status() -> None:
    e = errors.ClientError("placer said no", status=409)
    assert (str(e), e.status) == ("placer said no", 409)
    assert errors.HTTPError(404, "no such job").status == 404
