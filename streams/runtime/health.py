"""The web server of a running process (worker or agent runner): `/metrics`, `/healthz`, `/readyz`.

Faust hosts both processes: their lifecycle, signals, logging and this web server. Records do
not go through Faust's streams (`memfilter.runtime.loop` says why), so the app made here
starts only its web server and sensors. Only the documented settings configure it, never
Faust's own variables (WEB_PORT, ...).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import faust
from faust.app.base import BootStrategy

from memfilter.metrics import LoopMetrics
from memfilter.settings import Settings


class _WebOnly(BootStrategy):
    """Faust starts its web server and sensors; the records go through the task loop."""

    enable_kafka = False


def serve_health(
    name: str, settings: Settings, datadir: str, port: int, metrics: LoopMetrics, problems: Callable[[], list[str]], redis: Any = None
) -> faust.App:
    """A Faust app that serves `/metrics`, `/healthz` and `/readyz` (ready when `problems()`
    names none and `redis`, if given, answers), for the worker and the agent runner alike."""
    web_bind = settings.worker.web_bind
    app = faust.App(
        name,
        broker=f"kafka://{settings.kafka.bootstrap}",
        store="memory://",
        datadir=datadir,
        web_host=web_bind,
        web_port=port,
        web_bind=web_bind,
        env={},
    )
    app.boot_strategy = _WebOnly(app)

    @app.page("/metrics")
    async def metrics_page(web, request):
        return web.bytes(metrics.render(), content_type="text/plain; version=0.0.4")

    @app.page("/healthz")
    async def healthz(web, request):
        return web.text("ok\n")

    @app.page("/readyz")
    async def readyz(web, request):
        found = problems()
        if redis is not None:
            try:
                await asyncio.wait_for(redis.ping(), 1.0)
            except Exception as e:  # any failure to answer is "not ready", named in the reply
                found.append(f"Redis not answering ({type(e).__name__})")
        if found:
            return web.text("not ready: " + "; ".join(found) + "\n", status=503)
        return web.text("ready\n")

    return app
