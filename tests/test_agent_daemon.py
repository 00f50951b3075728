"""The agent as a real process: SIGKILL and restart with live workloads, SIGTERM leaves
workloads running, sd_notify over an abstract socket, a resumed countdown."""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid
from pathlib import Path

import httpx
import msgspec
import trio

from agent import procs
from infra.auth import TokenSet, auth_header
from scheduler_link.messages import Placement, PodAssignment
from testing.waiting import Changes, poll

ROOT = Path(__file__).resolve().parent.parent

TRAP = r"""
trap 'echo term >> "$HERD_SCRATCH/terms"; [ "$IGNORE" = 1 ] || { echo ckpt > "$HERD_SCRATCH/checkpoint"; exit 0; }' TERM
echo $$ > "$HERD_SCRATCH/started"
n=0; while [ ! -e "$HERD_SCRATCH/go" ] && [ $n -lt 600 ]; do sleep 0.05; n=$((n+1)); done  # bounded: 30 s
exit 5
"""


class AgentProc:
    def __init__(self, tmp: Path, token_dir: Path) -> None:
        self.tmp, self.token_dir = tmp, token_dir
        self.state = tmp / "state"
        self.proc: trio.Process | None = None
        self.url = ""

    async def start(self, env_extra: dict[str, str] | None = None) -> str:
        (self.state / "endpoints.json").unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        env.update(env_extra or {})
        log = os.open(self.tmp / "agent.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "cli.main", "--log-level", "INFO", "agent", "run", "--node-id", "n1",
             "--gpus", "simulated:dgx-h100", "--state-dir", str(self.state), "--listen", "127.0.0.1:0",
             "--no-data-plane", "--token-dir", str(self.token_dir), "--gpu-poll-interval-s", "0.5"],
            cwd=str(ROOT), env=env, stdout=log, stderr=log)
        os.close(log)
        with trio.fail_after(30):
            while not await trio.Path(self.state / "endpoints.json").exists():
                assert self.proc.poll() is None, (self.tmp / "agent.log").read_text()[-3000:]
                await trio.sleep(0.05)
        self.url = msgspec.json.decode((self.state / "endpoints.json").read_bytes())["control_url"]
        return self.url

    async def signal(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        with trio.fail_after(15):
            return await self.proc.wait()


async def get_wl(c: httpx.AsyncClient, wid: str) -> dict:
    r = await c.get(f"/v1/workloads/{wid}")
    assert r.status_code == 200, r.text
    return r.json()


async def wait_wl(c: httpx.AsyncClient, wid: str, *states: str) -> dict:
    """The workload's status once in one of ``states``, polled over the agent's API (another
    process); the caller bounds it."""
    async def there() -> dict | None:
        w = await get_wl(c, wid)
        return w if w["state"] in states else None
    return await poll(there, 0.05)


async def test_sigkill_restart_readopts_and_learns_exit_codes(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    op = auth_header(tokens.operator)
    agent = AgentProc(tmp_path, token_dir)
    # sd_notify: an abstract datagram socket, like systemd's
    name = f"herd-test-{uuid.uuid4().hex[:8]}"
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind("\0" + name)
    got: list[str] = []
    notified = Changes()   # poked by every sd_notify datagram the agent sends

    async def collect() -> None:
        while True:
            got.extend((await sock.recv(4096)).decode().splitlines())
            notified.poke()

    try:
        with trio.fail_after(80):
            async with trio.open_nursery() as n:
                n.start_soon(collect)
                url = await agent.start({"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "200000"})
                async with httpx.AsyncClient(base_url=url, headers=auth_header(TokenSet.load(token_dir).viewer)) as c:
                    gpus = [g["uuid"] for g in (await c.get("/v1/gpus")).json()["gpus"]]
                    await notified.until(lambda: "READY=1" in got and got.count("WATCHDOG=1") >= 2)
                    assert any(s.startswith("STATUS=8 simulated GPUs") for s in got)
                    for wid, gpu, env, grace in (("w", gpus[0], {}, 30.0), ("t", gpus[1], {"IGNORE": "1"}, 30.0)):
                        p = Placement(placement_id=f"p-{wid}", job_id="j", argv=["sh", "-c", TRAP], env=env,
                                      grace_s=grace, pods=[PodAssignment(workload_id=wid, rank=0, gpus=[gpu])])
                        r = await c.post("/v1/placements", content=msgspec.json.encode(p), headers=op)
                        assert r.status_code == 200, r.text
                    w = await wait_wl(c, "w", "running")
                    await wait_wl(c, "t", "running")
                    # t: a stop with a 4 s grace period; the agent dies during it
                    r = await c.post("/v1/workloads/t/stop", content=b'{"grace_s": 4, "reason": "preempted", "preempted": true}',
                                     headers=op)
                    deadline = trio.current_time() + 4
                    scr_t = agent.state / "workloads" / "t" / "scratch"
                    with trio.fail_after(5):
                        await poll(trio.Path(scr_t / "terms").exists, 0.05)
                    await trio.sleep(0.2)  # let term_sent be persisted

                assert await agent.signal(signal.SIGKILL) == -signal.SIGKILL
                pid = w["pid"]
                assert procs.start_time(pid) is not None  # the workload outlived its agent

                url = await agent.start()
                back = trio.current_time()
                async with httpx.AsyncClient(base_url=url, headers=auth_header(TokenSet.load(token_dir).viewer)) as c:
                    w2 = await get_wl(c, "w")
                    assert (w2["state"], w2["pid"]) == ("running", pid)
                    t = await get_wl(c, "t")
                    if back < deadline - 0.5:  # (a very slow restart may come back after the deadline)
                        assert t["state"] == "terminating"  # not killed at once
                    t = await wait_wl(c, "t", "preempted", "exited", "lost")
                    ended = trio.current_time()
                    assert (t["state"], t["exit_code"]) == ("preempted", 128 + signal.SIGKILL)
                    # killed at the recorded deadline, not after a fresh grace period
                    assert deadline - 0.2 <= ended <= max(deadline, back) + 1.5
                    assert (scr_t / "terms").read_text() == "term\n"   # one SIGTERM, not two
                    # GPU still booked by the adopted workload
                    p = Placement(placement_id="p-x", job_id="j", argv=["true"],
                                  pods=[PodAssignment(workload_id="x", rank=0, gpus=[gpus[0]])])
                    r = await c.post("/v1/placements", content=msgspec.json.encode(p), headers=op)
                    assert r.status_code == 409

                # SIGTERM stops the agent, not the workloads
                assert await agent.signal(signal.SIGTERM) == 0
                assert procs.start_time(pid) is not None
                url = await agent.start({"NOTIFY_SOCKET": "@" + name})
                async with httpx.AsyncClient(base_url=url, headers=auth_header(TokenSet.load(token_dir).viewer)) as c:
                    assert (await get_wl(c, "w"))["state"] == "running"
                    (agent.state / "workloads" / "w" / "scratch" / "go").touch()
                    w3 = await wait_wl(c, "w", "exited", "lost")
                    assert (w3["state"], w3["exit_code"]) == ("exited", 5)
                got.clear()
                assert await agent.signal(signal.SIGTERM) == 0
                with trio.fail_after(5):
                    await notified.until(lambda: "STOPPING=1" in got)
                n.cancel_scope.cancel()
    finally:
        sock.close()
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.kill()
            await agent.proc.wait()
