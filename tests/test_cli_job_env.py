"""`herd job submit --env / --env-from-file` and `herd job show`: through the real `herd` entry
point against an in-process placer; show (text and --json) names env variables, never their values."""

from __future__ import annotations

import json

import trio

from infra.auth import TokenSet

from .test_cli_job import herd, one_line
from .test_placer_service import start_cluster


async def test_show_names_env_and_never_prints_a_value(tmp_path, token_dir):
    tokens = TokenSet.load(token_dir)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            _, cl = await start_cluster(n, tmp_path, tokens, n_agents=1)
            env = {"HERD_PLACER": cl.url, "HERD_TOKEN_DIR": str(token_dir)}
            rc, out, err = await herd(["job", "submit", "--job-id", "e1", "--env", "API_KEY=v-5521",
                                       "--env-from-file", "DB=/etc/herd/secrets/db", "--json", "--", "sleep", "30"],
                                      env)
            assert rc == 0, err
            assert "v-5521" not in out
            rc, out, err = await herd(["job", "show", "e1"], env)
            assert rc == 0, err
            assert "env: API_KEY (values not shown)" in out and "DB=/etc/herd/secrets/db" in out
            assert "v-5521" not in out
            rc, out, err = await herd(["job", "show", "e1", "--json"], env)
            spec = json.loads(out)["spec"]
            assert spec["env"] == {"API_KEY": "<redacted>"} and "v-5521" not in out
            rc, out, err = await herd(["job", "submit", "--env-from-file", "DB", "--", "x"], env)
            assert rc == 1 and "expected K=PATH" in one_line(err)
            rc, out, err = await herd(["job", "submit", "--env-from-file", "DB=relative", "--", "x"], env)
            assert rc == 1 and "absolute host path" in one_line(err), err
            n.cancel_scope.cancel()
