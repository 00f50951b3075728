"""`herd job …` through the real `herd` entry point (a subprocess) against an in-process
placer with fake agents: argument order, job files, --wait exit codes, validation, id
prefixes, and `herd node cordon|drain|uncordon` with `herd nodes`."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import trio

from infra.auth import TokenSet
from tests.prom import value

from .test_placer_service import start_cluster, wait_for

_SCRIPT = Path(sys.executable).with_name("herd")
HERD = [str(_SCRIPT)] if _SCRIPT.exists() else ([shutil.which("herd")] if shutil.which("herd") else
                                                [sys.executable, "-m", "cli.main"])


async def herd(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the `herd` console script; (exit status, stdout, stderr)."""
    r = await trio.run_process([*HERD, *args], capture_stdout=True, capture_stderr=True, check=False,  # type: ignore[list-item]
                               env={**os.environ, **(env or {})})
    return r.returncode, r.stdout.decode(), r.stderr.decode()


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


async def test_submit_order_job_files_validation_and_prefixes(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            env = {"HERD_PLACER": cl.url, "HERD_TOKEN_DIR": str(token_dir)}
            job = tmp_path / "job.toml"
            job.write_text('[job]\njob_id = "alpha-1"\npods = 1\ngpus_per_pod = 2\nargv = ["sleep", "30"]\n')
            # the README's order: file, then flags; the file's argv runs (not "--wait running")
            rc, out, err = await herd(["job", "submit", str(job), "--wait", "running", "--json"], env)
            assert rc == 0, err
            v = json.loads(out)
            assert v["state"] == "running" and v["spec"]["argv"] == ["sleep", "30"], v
            # flags before and after the file; -- ARGV overrides the file's argv
            rc, out, err = await herd(["job", "submit", "--pods", "2", str(job), "--job-id", "alpha-2", "--json",
                                       "--", "echo", "--wait", "hi"], env)
            assert rc == 0, err
            v = json.loads(out)
            assert v["spec"]["argv"] == ["echo", "--wait", "hi"] and v["spec"]["pods"] == 2
            assert v["spec"]["gpus_per_pod"] == 2 and v["job_id"] == "alpha-2"
            # unknown job-file keys are errors naming the key; nothing is submitted
            bad = tmp_path / "bad.toml"
            bad.write_text('pods = 1\ngpus = 2\nargv = ["x"]\n')
            rc, out, err = await herd(["job", "submit", str(bad)], env)
            assert rc == 1 and "unknown key 'gpus'" in one_line(err), err
            bad.write_text('[job]\npods = 1\n[extra]\nx = 1\n')
            rc, out, err = await herd(["job", "submit", str(bad)], env)
            assert rc == 1 and "'extra'" in one_line(err), err
            bad.write_text('within = "galaxy"\nargv = ["x"]\n')
            rc, out, err = await herd(["job", "submit", str(bad)], env)
            assert rc == 1 and "galaxy" in one_line(err) and "rack" in err, err
            # enumerated flags: the allowed values in one line, exit 2
            for args, allowed in ((["job", "list", "--state", "bogus"], "'pending'"),
                                  (["job", "submit", "--wait", "bogus", "--", "x"], "'succeeded'"),
                                  (["job", "submit", "--within", "bogus", "--", "x"], "'nvlink'"),
                                  (["nodes", "--state", "bogus"], "'lost'")):
                rc, out, err = await herd(args, env)
                assert rc == 2 and "bogus" in one_line(err) and allowed in err, (args, err)
            rc, out, err = await herd(["job", "submit", "--restart", "sometimes", "--", "x"], env)
            assert rc == 1 and "never | on-failure:N | on-preemption" in one_line(err)
            # ids as printed: a unique prefix is accepted, an ambiguous one names the candidates
            rc, out, err = await herd(["job", "show", "alpha-2", "--json"], env)
            assert rc == 0 and json.loads(out)["job_id"] == "alpha-2"
            rc, out, err = await herd(["job", "show", "alpha"], env)
            assert rc == 1 and "ambiguous" in one_line(err) and "alpha-1" in err and "alpha-2" in err
            rc, out, err = await herd(["job", "show", "nope"], env)
            assert rc == 1 and "404" in one_line(err)
            rc, out, err = await herd(["job", "cancel", "alpha-", "--wait"], env)
            assert rc == 1 and "ambiguous" in err
            rc, out, err = await herd(["job", "cancel", "alpha-2", "--wait", "--json"], env)
            assert rc == 0 and json.loads(out)["state"] == "cancelled", err
            n.cancel_scope.cancel()


async def test_wait_exits_non_zero_unless_the_state_was_reached(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            env = {"HERD_PLACER": cl.url, "HERD_TOKEN_DIR": str(token_dir)}
            got: dict[str, tuple[int, str, str]] = {}

            async def submit() -> None:
                got["r"] = await herd(["job", "submit", "--job-id", "f1", "--wait", "succeeded", "--",
                                       "/bin/false"], env)
            n.start_soon(submit)
            # the job runs; its workload then exits 1 (what /bin/false does on a real agent)
            with trio.fail_after(30):
                v = await wait_for(lambda: _running(svc, "f1"))
            pod = v.pods[0]
            cl.agents[pod.node_id].exit(pod.workload_id, 1)
            with trio.fail_after(30):
                await wait_for(lambda: _done(got))
            rc, out, err = got["r"]
            assert rc == 1, (out, err)
            assert "submitted f1" in out
            assert "job f1 ended failed, not succeeded" in one_line(err), err
            # a wait that times out: non-zero, the state it is in
            rc, out, err = await herd(["job", "submit", "--job-id", "t1", "--wait", "succeeded",
                                       "--wait-timeout", "1", "--", "sleep", "60"], env)
            assert rc == 1 and "did not reach succeeded within 1s (now running" in one_line(err), err
            # cancelling a job that already ended cannot say cancelled
            rc, out, err = await herd(["job", "cancel", "f1", "--wait"], env)
            assert rc == 1, (out, err)
            n.cancel_scope.cancel()


async def _running(svc, job_id: str):
    job = svc.state.jobs.get(job_id)
    if job is None or job.state != "running":
        return None
    return svc.state.job_view(job)


async def _done(got: dict) -> bool:
    return "r" in got


async def test_node_cordon_drain_uncordon_and_nodes(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(90):
        async with trio.open_nursery() as n:
            svc, cl = await start_cluster(n, tmp_path, tokens, n_agents=2)
            env = {"HERD_PLACER": cl.url, "HERD_TOKEN_DIR": str(token_dir)}
            rc, out, err = await herd(["job", "submit", "--job-id", "p", "--gpus-per-pod", "8", "--restart",
                                       "on-preemption", "--wait", "running", "--json", "--", "sleep", "60"], env)
            assert rc == 0, err
            node = json.loads(out)["pods"][0]["node_id"]
            other = ({"n0", "n1"} - {node}).pop()
            rc, out, err = await herd(["job", "submit", "--job-id", "np", "--gpus-per-pod", "8", "--not-preemptible",
                                       "--wait", "running", "--json", "--", "sleep", "60"], env)
            assert rc == 0 and json.loads(out)["pods"][0]["node_id"] == other, err
            rc, out, err = await herd(["node", "cordon", other], env)
            assert rc == 0 and f"node {other}: cordoned" in out, err
            rc, out, err = await herd(["node", "drain", other, "--json"], env)
            assert rc == 0, err
            d = json.loads(out)
            assert d["left"] == ["np"] and d["stopped"] == [] and d["node"]["cordoned"]
            rc, out, err = await herd(["nodes"], env)
            assert rc == 0 and "SCHED" in out, out
            row = next(line for line in out.splitlines() if line.startswith(other))
            assert "draining" in row, out
            # the preemptible gang on the first node moves once that node is drained: nowhere
            # to go while both are out of service, so it waits (pending)
            rc, out, err = await herd(["node", "drain", node, "--grace", "1", "--wait", "--wait-timeout", "20"], env)
            assert rc == 0 and "stopping p" in out and "(0 workload(s) on it)" in out, (out, err)
            assert svc.state.jobs["p"].state == "pending"
            rc, out, err = await herd(["nodes", "--json"], env)
            views = {x["node_id"]: x for x in json.loads(out)["nodes"]}
            assert views[node]["cordoned"] and not views[node]["draining"] and views[other]["draining"]
            assert value((await cl.c.get("/metrics")).text, "herd_placer_nodes_cordoned") == 2
            rc, out, err = await herd(["node", "uncordon", node], env)
            assert rc == 0 and f"node {node}: schedulable" in out
            with trio.fail_after(30):
                v = await wait_for(lambda: _running(svc, "p"))
            assert v.pods[0].node_id == node
            # unknown node; not an operator
            rc, out, err = await herd(["node", "cordon", "nope"], env)
            assert rc == 1 and "404" in one_line(err)
            view_env = {**env, "HERD_TOKEN_DIR": str(tmp_path / "nowhere")}
            rc, out, err = await herd(["node", "cordon", node], view_env)
            assert rc == 1 and "401" in one_line(err)
            n.cancel_scope.cancel()
