"""``POST /v1/probe`` on the (unauthenticated) admin server takes only a JSON body sent as such:
a web page can make a browser POST cross-site only as a form or text/plain, so it cannot start
WAN probes through an agent on loopback."""

from __future__ import annotations

import aiohttp

from support.agents import run_agents, two_site_toml

# 2 s: the 1 s of goodput it measures (after a 0.25 s warm-up) must hold acknowledgements on a
# loaded machine (CI) too, where this process may not run for a few hundred ms (at 0.5 s, such a
# stall left none in the window: 409 PROBE_FAILED "too few acknowledgements").
BODY = b'{"peer": "B", "seconds": 2, "streams": 1}'


async def test_a_probe_without_a_json_content_type_is_refused(tmp_sock_dir):
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        url = f"http://{agents['A'].admin.address}/v1/probe"
        async with aiohttp.ClientSession() as s:
            # What a cross-site form or fetch() without preflight can send; and no type at all.
            for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                          None):
                headers = {} if ctype is None else {"Content-Type": ctype}
                async with s.post(url, data=BODY, headers=headers, skip_auto_headers=["Content-Type"]) as r:
                    assert r.status == 415, ctype
                    assert "needs Content-Type: application/json" in await r.text()
            # The same body, sent as JSON, is a probe.
            async with s.post(url, data=BODY, headers={"Content-Type": "application/json; charset=utf-8"}) as r:
                assert r.status == 200, await r.text()
                res = await r.json()
                assert res["peer"] == "B/b1"


async def test_a_probe_with_values_out_of_range_is_a_bad_request(tmp_sock_dir):
    """400 for what the request itself gets wrong; 409 only for what the agent cannot do now."""
    async with run_agents(two_site_toml(tmp_sock_dir)) as agents:
        url = f"http://{agents['A'].admin.address}/v1/probe"
        async with aiohttp.ClientSession() as s:
            for body in ({"peer": "B", "seconds": -1}, {"peer": "B", "seconds": 1e9},
                         {"peer": "B", "seconds": 1, "streams": 0}):
                async with s.post(url, json=body) as r:
                    assert r.status == 400, (body, await r.text())
                    assert (await r.json())["code"] == "BAD_REQUEST"
