"""`herd version`, `--version`, `completion`, help text on every flag, `--timeout`, and a
server that is not herd — through the real `herd` entry point."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time

import pytest
import trio

from cli.main import build_parser
from infra.auth import TokenSet
from scheduler_link.messages import WIRE_VERSION

from .test_cli_job import herd, one_line
from .test_placer_service import start_cluster

HTML = (b"HTTP/1.1 404 Not Found\r\ncontent-type: text/html\r\ncontent-length: 60\r\nconnection: close\r\n\r\n"
        b"<html><body><h1>404 Not Found</h1><p>nginx</p></body></html>")


async def _serve(nursery: trio.Nursery, answer: bytes | None) -> str:
    """A loopback TCP server that answers every request with ``answer`` (None: reads and
    never answers, like a hung daemon)."""
    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await stream.receive_some(65536)
                if answer is None:
                    await trio.sleep_forever()
                await stream.send_all(answer)
            except trio.BrokenResourceError:
                pass
    listeners = await nursery.start(trio.serve_tcp, handle, 0)  # type: ignore[arg-type]
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_version_and_completion():
    rc, out, err = await herd(["--version"])
    assert rc == 0 and out.strip() == f"herd 0.1.0 (wire {WIRE_VERSION}, Python {platform.python_version()})"
    rc, out, err = await herd(["version", "--json"], {"HERD_PLACER": "", "HERD_AGENT": ""})
    assert rc == 0 and json.loads(out) == {"herd": "0.1.0", "wire": WIRE_VERSION,
                                           "python": platform.python_version()}
    for shell in ("bash", "zsh", "fish"):
        rc, out, err = await herd(["completion", shell])
        assert rc == 0 and "herd" in out and "submit" in out and "cordon" in out, (shell, err)
        if shell == "bash" and shutil.which("bash"):
            await trio.run_process(["bash", "-n"], stdin=out.encode())  # it parses
    rc, out, err = await herd(["completion", "tcsh"])
    assert rc == 2 and "'fish'" in one_line(err)


def test_every_flag_and_positional_has_help():
    missing = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, f"{path} {name}")
            elif not a.help:
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")
    walk(build_parser(), "herd")
    assert not missing, missing


async def test_timeouts_and_servers_that_are_not_herd(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            hung = await _serve(n, None)
            html = await _serve(n, HTML)
            env = {"HERD_TOKEN_DIR": str(token_dir)}
            # a daemon that never answers: --timeout bounds every command that asks one
            for args in (["job", "list", "--placer", hung], ["nodes", "--placer", hung],
                         ["node", "cordon", "x", "--placer", hung], ["status", "--agent", hung],
                         ["logs", "w", "--agent", hung], ["placer", "defrag", "--placer", hung],
                         ["gpus", "inject", "--agent", hung, "--gpu", "G", "--xid", "79"]):
                t0 = time.monotonic()
                rc, out, err = await herd([*args, "--timeout", "0.5"], env)
                assert rc == 1 and "did not answer in time" in one_line(err), (args, err)
                assert time.monotonic() - t0 < 9, args   # well under the 10 s default (a loaded start-up takes seconds)
            # an HTML page: one line saying it is not herd, never the page
            for args in (["job", "list", "--placer", html], ["job", "show", "x", "--placer", html],
                         ["status", "--agent", html], ["logs", "w", "--agent", html],
                         ["gpus", "inject", "--agent", html, "--gpu", "G", "--xid", "79"],
                         ["version", "--placer", html]):
                rc, out, err = await herd(args, env)
                assert rc == 1, (args, out, err)
                line = one_line(err) if args[0] != "version" else out.strip().splitlines()[-1]
                assert "not a herd server" in line and "<html" not in err + out, (args, err, out)
            # a real placer says its version
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=1)
            rc, out, err = await herd(["version", "--placer", cl.url, "--json"], env)
            assert rc == 0, err
            assert json.loads(out)["placer"] == {"url": cl.url, "version": "0.1.0", "wire": WIRE_VERSION}
            rc, out, err = await herd(["version", "--placer", cl.url], env)
            assert rc == 0 and f"placer {cl.url}: herd 0.1.0 (wire {WIRE_VERSION})" in out
            n.cancel_scope.cancel()


@pytest.mark.parametrize("argv", [["job", "submit", "--timeout", "0", "--", "x"]])
async def test_bad_timeout_is_refused(argv):
    rc, out, err = await herd(argv, {"HERD_PLACER": "http://127.0.0.1:9"})
    assert rc == 1 and "--timeout must be > 0" in one_line(err)
