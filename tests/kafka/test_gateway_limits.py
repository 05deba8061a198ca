"""Fair limits per caller on a real gateway (`memfilter.gateway.limits`), at its defaults, with
a worker and the echo agent runner behind it: one caller flooding the gateway with turns gets
429 `rate-limited` with `Retry-After` past its share, in the error shape the AI SDK's client
shows, while another caller's turns are answered. (How much the flood delays the other
caller's first token is measured, not asserted: `python -m benchmarks.gateway_fairness`.) The AI
SDK's own client sees a refusal as its chat's error (tests/node/limits.test.mjs)."""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import pytest
from pipeline import node_test

from memfilter.settings import Gateway

pytestmark = pytest.mark.xdist_group("gateway-limits")


@pytest.fixture(scope="module")
def gateway(services):
    pipeline = services.pipeline()
    asyncio.run(pipeline.create_topics())
    try:
        pipeline.start_answering()
        yield f"http://127.0.0.1:{pipeline.start_gateway('limits', MEMFILTER_GATEWAY_AUTH='header')}"
    finally:
        pipeline.stop_all()
        asyncio.run(pipeline.delete_topics())


async def turn(http: aiohttp.ClientSession, gateway: str, user: str, text: str) -> tuple[int, dict | str, str | None]:
    """A useChat turn of `user` on a chat of its own: (status, the error or the answer's text, Retry-After)."""
    chat = f"limits-{uuid.uuid4().hex[:8]}"
    body = {"id": chat, "trigger": "submit-message", "messages": [{"id": f"{chat}-u0", "role": "user", "parts": [{"type": "text", "text": text}]}]}
    async with http.post(f"{gateway}/api/chat", json=body, headers={"X-Memfilter-Resource": user}) as r:
        if r.status != 200:
            return r.status, (await r.json())["error"], r.headers.get("Retry-After")
        events = [line.removeprefix("data: ") for line in (await r.text()).splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        return 200, "".join(json.loads(e).get("delta", "") for e in events), None


def test_a_flooding_caller_is_refused_past_its_share_and_another_is_answered_meanwhile(gateway):
    defaults = Gateway()
    flood_size = defaults.caller_burst * 3

    async def go():
        async with aiohttp.ClientSession() as http:
            flood = asyncio.gather(*(turn(http, gateway, "flooder", f"flood {n}") for n in range(flood_size)))
            calm = [await turn(http, gateway, "calm", f"calm {n}") for n in range(3)]
            return await flood, calm

    flooded, calm = asyncio.run(go())
    assert calm == [(200, f"echo: calm {n}", None) for n in range(3)]
    refused = [(error, after) for status, error, after in flooded if status == 429]
    answered = [answer for status, answer, _ in flooded if status == 200]
    assert len(refused) + len(answered) == flood_size and len(answered) <= defaults.caller_burst and refused
    for error, after in refused:
        assert error["code"] == "rate-limited" and int(after) >= 1 and f"try again in {after} s" in error["message"]
    assert any("MEMFILTER_GATEWAY_CALLER_IN_FLIGHT" in error["message"] for error, _ in refused)  # the flood held more open than its share


def test_the_ai_sdks_client_shows_turns_past_a_users_share_as_refused_and_gets_the_others_answered(gateway):
    result = node_test("limits.test.mjs", GATEWAY_URL=gateway, RESOURCE_HEADER=Gateway().resource_header)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def test_many_callers_at_once_are_each_answered_not_refused_for_want_of_a_redis_connection(gateway):
    """Each request reads Redis; more at once than the client's pool holds (100) wait for a
    connection rather than fail (a 500 `Too many connections`, found by benchmarks/gateway_streams.py)."""

    async def go():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

            async def read(n: int) -> int:
                async with http.get(f"{gateway}/api/threads/many-{n}/messages", headers={"X-Memfilter-Resource": f"many-{n}"}) as r:
                    return r.status

            return await asyncio.gather(*(read(n) for n in range(400)))

    assert set(asyncio.run(go())) == {200}


def test_a_caller_past_its_share_is_refused_on_the_thread_routes_before_any_thread_is_read(gateway):
    """Past its burst, a caller's reads of a thread are answered 429 whether the thread is
    theirs or another's: the share is taken before the ownership read, so a flood of them costs
    no Redis read, and tells nothing of whose threads exist."""
    burst, theirs = Gateway().caller_burst, f"limits-theirs-{uuid.uuid4().hex[:8]}"

    async def go():
        async with aiohttp.ClientSession() as http:
            body = {
                "id": theirs,
                "trigger": "submit-message",
                "messages": [{"id": f"{theirs}-u0", "role": "user", "parts": [{"type": "text", "text": "mine"}]}],
            }
            async with http.post(f"{gateway}/api/chat", json=body, headers={"X-Memfilter-Resource": "owner"}) as r:
                assert r.status == 200 and '"type":"finish"' in await r.text()  # the thread is the owner's now

            async def read(thread: str) -> int:
                async with http.get(f"{gateway}/api/threads/{thread}/messages", headers={"X-Memfilter-Resource": "reader"}) as r:
                    return r.status

            within = [await read(theirs), *[await read(f"reader-own-{n}") for n in range(burst - 1)]]
            return within, await read(theirs), await read("reader-own-0")

    within, others, own = asyncio.run(go())
    assert within == [403] + [200] * (burst - 1) and (others, own) == (429, 429)
