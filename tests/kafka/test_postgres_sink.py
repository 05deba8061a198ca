"""The PostgreSQL tier end to end: a worker, the agent runner and `memfilter sink` on a real
Kafka, Redis and PostgreSQL. PostgreSQL holds every thread as the log leaves it, idle threads
leave Redis and come back on their next request, and a PostgreSQL stopped or killed under
load costs the cold threads alone (refused with the reason, to publish again): the threads in
Redis go on, and the sink catches up once it is back, nothing lost.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid

import aiohttp
import asyncpg
from factories import T0, msg
from pipeline import Pipeline, publish, read
from stacks import REPO, signal_postgres, start_postgres

from memfilter.store.cold import evict
from memfilter.store.postgres import PostgresHistory

THREADS = 12


def request(thread: str, messages: list[dict], n: int) -> tuple:
    value = {"threadId": thread, "resourceId": "r1", "requestId": f"{thread}-q{n}", "messages": messages}
    return thread.encode(), json.dumps(value).encode(), T0 + n


async def held(pipeline: Pipeline) -> dict[str, list[str]]:
    """Each thread's conversation as PostgreSQL holds it: message ids in order."""
    conn = await asyncpg.connect(pipeline.postgres_url)
    try:
        rows = await conn.fetch(f'SELECT thread_id, id FROM "{pipeline.prefix}".mastra_messages WHERE position IS NOT NULL ORDER BY thread_id, position')
    except asyncpg.UndefinedTableError:
        return {}
    finally:
        await conn.close()
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["thread_id"], []).append(r["id"])
    return out


async def until(check, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while not (result := await check()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.3)
    return result


async def cold_threads(pipeline: Pipeline, threads: list[str]) -> int:
    _, store = pipeline.store()
    try:
        return sum([bool(await store.redis.hexists(store.keys(t).meta, "cold")) for t in threads])
    finally:
        await store.redis.aclose()


def test_postgresql_holds_every_thread_and_idle_threads_leave_redis_and_come_back(pipeline):
    threads = [f"t{i}-{uuid.uuid4().hex[:6]}" for i in range(THREADS)]
    pipeline.start_worker()
    pipeline.start_agent()
    pipeline.start_sink(MEMFILTER_IDLE_S="2")
    t = pipeline.topics

    async def go():
        await publish(pipeline.bootstrap, t.requests, [request(th, [msg(f"{th}-u0")], 0) for th in threads])
        first = await until(lambda: _all_held(pipeline, threads, 2))  # each question and the echo agent's answer
        await until(lambda: _equal(cold_threads(pipeline, threads), THREADS))
        answers = {th: ids[1] for th, ids in first.items()}
        second = [request(th, [msg(f"{th}-u0"), msg(answers[th], "assistant", "echo"), msg(f"{th}-u1")], 1) for th in threads]
        await publish(pipeline.bootstrap, t.requests, second)
        records = await read(pipeline.bootstrap, [t.filtered, t.dlq], until=lambda recs: len(recs) >= 2 * THREADS)
        return records, await until(lambda: _all_held(pipeline, threads, 4))

    records, final = asyncio.run(go())
    assert [r.topic for r in records] == [t.filtered] * 2 * THREADS
    contexts = {json.loads(r.value)["requestId"]: [m["id"] for m in json.loads(r.value)["context"]] for r in records}
    for th in threads:  # decided on the thread loaded back: the stored answer is in the context
        assert contexts[f"{th}-q1"] == final[th][:3]
        assert final[th][0] == f"{th}-u0" and final[th][2] == f"{th}-u1"


async def _all_held(pipeline: Pipeline, threads: list[str], n: int):
    h = await held(pipeline)
    return h if all(len(h.get(th, [])) == n for th in threads) else None


async def _equal(value, want) -> bool:
    return (await value) == want


def test_postgresql_stopped_or_killed_under_load_costs_the_cold_threads_alone_and_loses_nothing(services):
    folder = REPO / ".stack" / f"postgres-kill-{uuid.uuid4().hex[:8]}"
    server, url = start_postgres(folder)
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    pipeline = Pipeline(services.bootstrap, services.redis_url, settings=services.settings, postgres_url=url)
    threads = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(THREADS)]
    cold, warm = threads[: THREADS // 2], threads[THREADS // 2 :]
    t = pipeline.topics
    try:
        asyncio.run(pipeline.create_topics())
        pipeline.start_worker(MEMFILTER_POSTGRES_TIMEOUT="1")
        sink = pipeline.start_sink(MEMFILTER_POSTGRES_TIMEOUT="1")

        async def evict_idle_half():
            await publish(pipeline.bootstrap, t.requests, [request(th, [msg(f"{th}-u0")], 0) for th in threads])
            await until(lambda: _all_held(pipeline, threads, 1))
            cutoff = int(time.time() * 1000) + 1
            await asyncio.sleep(0.5)
            await publish(pipeline.bootstrap, t.requests, [request(th, [msg(f"{th}-u0"), msg(f"{th}-u1")], 1) for th in warm])
            await until(lambda: _all_held(pipeline, warm, 2))
            _, store = pipeline.store()
            pg = PostgresHistory(url, pipeline.prefix)
            try:
                assert await evict(store, pg, cutoff) == len(cold)  # as the sink evicts idle threads
            finally:
                await pg.close()
                await store.redis.aclose()

        asyncio.run(evict_idle_half())
        signal_postgres(server.pid, signal.SIGSTOP)  # PostgreSQL hangs: every connection waits
        try:
            turn = [request(th, [msg(f"{th}-u0"), msg(f"{th}-u1")], 2) for th in cold] + [
                request(th, [msg(f"{th}-u0"), msg(f"{th}-u1"), msg(f"{th}-u2")], 2) for th in warm
            ]
            asyncio.run(publish(pipeline.bootstrap, t.requests, turn))
            stopped = asyncio.run(read(pipeline.bootstrap, [t.filtered, t.dlq], until=lambda recs: len(recs) >= 2 * THREADS + len(warm)))
        finally:
            signal_postgres(server.pid, signal.SIGCONT)
        outcome = {json.loads(r.value)["requestId"]: (r.topic, dict(r.headers).get("error.type")) for r in stopped}
        assert all(outcome[f"{th}-q2"] == (t.filtered, None) for th in warm)  # threads in Redis: decided as ever
        assert all(outcome[f"{th}-q2"] == (t.dlq, b"unavailable") for th in cold)  # cold ones: refused with the reason, to publish again

        server.send_signal(signal.SIGKILL)
        server.wait(10)
        asyncio.run(publish(pipeline.bootstrap, t.requests, [request(th, [msg(f"{th}-u{n}") for n in range(4)], 3) for th in warm]))
        killed = asyncio.run(read(pipeline.bootstrap, [t.filtered], until=lambda recs: len(recs) >= THREADS + 3 * len(warm)))
        assert {json.loads(r.value)["requestId"] for r in killed} >= {f"{th}-q3" for th in warm}  # decided with PostgreSQL gone
        status, said = asyncio.run(until(lambda: readiness(sink.web_port, 503)))  # the sink is not ready, and says why
        assert said.startswith("not ready: writing threads: PostgreSQL at ") and "did not answer" in said

        server = start_postgres(folder, port)[0]  # back on its data: the sink catches up, the cold threads load again
        # the cold threads' refused requests, published again as the dead letters say: decided now
        asyncio.run(publish(pipeline.bootstrap, t.requests, [request(th, [msg(f"{th}-u0"), msg(f"{th}-u1")], 2) for th in cold]))
        final = asyncio.run(until(lambda: _all_held(pipeline, warm, 4)))
        final |= asyncio.run(until(lambda: _all_held(pipeline, cold, 2)))
        assert all(final[th] == [f"{th}-u{n}" for n in range(4)] for th in warm)
        assert all(final[th] == [f"{th}-u0", f"{th}-u1"] for th in cold)
        assert asyncio.run(until(lambda: readiness(sink.web_port, 200)))[1] == "ready\n"
    finally:
        pipeline.stop_all()
        asyncio.run(pipeline.delete_topics())
        server.send_signal(signal.SIGINT)
        server.wait(30)


async def readiness(port: int, wanted: int) -> tuple[int, str] | None:
    """The sink's `/readyz` (status, text), once it answers `wanted`."""
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/readyz") as r:
        answer = (r.status, await r.text())
    return answer if answer[0] == wanted else None
