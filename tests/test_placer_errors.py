"""The placer's errors sit under one base, in one module, and third-party failures arrive mapped."""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import pytest
import trio

import placer
import placer.errors as errors
from placer.config import PlacerConfigError, load_config
from placer.errors import JobError, JournalError, PlacerError
from placer.journal import Journal

PLACER = Path(placer.__file__).parent
ROOT = Path(__file__).resolve().parent.parent


def test_every_placer_exception_is_a_placer_error_defined_in_errors_py():
    mine = [c for _, c in inspect.getmembers(errors, inspect.isclass)
            if issubclass(c, BaseException) and c.__module__ == errors.__name__]
    assert {c.__name__ for c in mine} >= {"PlacerError", "InvalidSpec", "UnknownNode", "UnknownJob", "Conflict",
                                          "JobError", "JournalError", "PlacerConfigError"}
    assert all(issubclass(c, PlacerError) for c in mine)
    elsewhere = []
    for f in PLACER.rglob("*.py"):
        if f.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id.endswith(("Error", "Exception")) for b in node.bases):
                elsewhere.append(f"{f.name}:{node.name}")
    assert elsewhere == []


def test_third_party_failures_are_mapped_where_they_enter(tmp_path):
    (tmp_path / "bad.toml").write_text("[placer\n")
    with pytest.raises(PlacerConfigError, match="not valid TOML") as e:
        load_config(tmp_path / "bad.toml")
    assert isinstance(e.value, PlacerError) and e.value.__cause__ is None
    (tmp_path / "typo.toml").write_text("[placer]\nlistenn = 1\n")
    with pytest.raises(PlacerError, match="unknown field `listenn`"):
        load_config(tmp_path / "typo.toml")
    d = tmp_path / "state"
    d.mkdir()
    (d / "jobs.journal").write_text('{"v": 1, "op": "end", "job_id": "a", "at": 1.0}\nnot json\n{"v": 1, "op": "end", "job_id": "b", "at": 2.0}\n')
    with pytest.raises(JournalError) as j:
        Journal.open(d)
    assert isinstance(j.value, PlacerError) and "line 2 is corrupt" in str(j.value)
    (d / "jobs.journal").unlink()
    (d / "jobs.journal").mkdir()  # an OSError on read: mapped, one line
    with pytest.raises(JournalError, match=r"cannot read journal .*jobs.journal: Is a directory$"):
        Journal.open(d)
    assert JobError("no such job x", status=404).status == 404 and isinstance(JobError("x"), PlacerError)


async def test_placer_start_failures_are_one_line(tmp_path):
    """A corrupt journal or a port in use stops ``herd placer run`` with one line (it was a
    traceback of trio's exception groups)."""
    root = ROOT
    state = tmp_path / "state"
    state.mkdir()
    busy = trio.socket.socket()
    await busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    env = {"PATH": "/usr/bin:/bin", "HERD_INSECURE": "1", "PYTHONPATH": str(root)}
    try:
        with trio.fail_after(60):
            for journal, listen, msg in (
                    ('{"v": 1, "op": "end", "job_id": "a", "at": 1.0}\nnot json\n{"v": 1}\n', "127.0.0.1:0",
                     "herd: error: journal " + str(state / "jobs.journal") + " line 2 is corrupt"),
                    ("", f"127.0.0.1:{port}", f"herd: error: placer failed: Address already in use (listen 127.0.0.1:{port}")):
                (state / "jobs.journal").write_text(journal)
                r = await trio.run_process(
                    [sys.executable, "-m", "cli.main", "placer", "run", "--state-dir", str(state), "--listen", listen,
                     "--token-dir", str(tmp_path / "tokens")],
                    cwd=str(root), env=env, capture_stdout=True, capture_stderr=True, check=False)
                # the insecure warning (HERD_INSECURE=1, once), then the error in one line
                warned, *rest = r.stderr.decode().strip().splitlines()
                assert "WARNING herd.link.tls placer is INSECURE" in warned, warned
                err = "\n".join(rest)
                assert r.returncode == 1 and err.startswith(msg) and len(rest) == 1, err
    finally:
        busy.close()


def test_the_placer_raises_no_bare_builtin_errors():
    """What the placer raises on purpose is a PlacerError (a BadRequest is still a ValueError for
    callers that catch that): no ``raise ValueError(...)`` and the like, except the protocol ones
    Python itself defines (NotImplementedError of an abstract method, AttributeError of
    ``__getattr__``, IndexError of a sequence's ``__getitem__``)."""
    import builtins
    allowed = {"NotImplementedError", "AttributeError"}
    bare = []
    for f in PLACER.rglob("*.py"):
        tree = ast.parse(f.read_text())
        getitem = {id(n) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name == "__getitem__"
                   for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                e = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(e, ast.Name) and isinstance(getattr(builtins, e.id, None), type) \
                        and e.id not in allowed and not (e.id == "IndexError" and id(node) in getitem):
                    bare.append(f"{f.name}:{node.lineno} {e.id}")
    assert bare == []
    assert issubclass(errors.BadRequest, PlacerError) and issubclass(errors.BadRequest, ValueError)

