"""The dashboard: its page (package data, nothing from the internet) and its JSON API.

Every API answer is read in one transaction on a worker thread (the event loop also carries
the DHT member), and names what it answers; the API is documented in the package README.
A run name that the database does not hold is a 404 with a JSON error, a bad query
parameter a 400: the page shows the message.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources

from aiohttp import web

from agora_core import world
from agora_monitor import __version__, queries
from agora_monitor.alerts import current_alerts
from agora_monitor.settings import MonitorSettings
from agora_monitor.store import MonitorStore

STATIC = resources.files("agora_monitor") / "static"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
STORE_KEY = web.AppKey("store", MonitorStore)
SETTINGS_KEY = web.AppKey("settings", MonitorSettings)


def _error(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json")


def _number(request: web.Request, name: str, kind: type, default):
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise _error(
            web.HTTPBadRequest, f"query parameter {name} must be a {kind.__name__}, got {raw[:40]}"
        ) from None


async def _read(request: web.Request, fn, *args, **kwargs):
    """``fn(connection, *args)`` in a read transaction, on a thread."""
    store = request.app[STORE_KEY]

    def run():
        with store.transaction() as connection:
            return fn(connection, *args, **kwargs)

    return await asyncio.to_thread(run)


async def _run_name(request: web.Request) -> str:
    run = request.match_info["run"]
    if await _read(request, queries.run_row, run) is None:
        raise _error(web.HTTPNotFound, f"no run named {run[:100]} in this database")
    return run


async def index(request: web.Request) -> web.Response:
    return web.Response(text=(STATIC / "index.html").read_text(), content_type="text/html")


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSETS:
        raise web.HTTPNotFound()
    return web.Response(text=(STATIC / name).read_text(), content_type=ASSETS[name])


async def api_runs(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS_KEY]
    return web.json_response(
        {"runs": await _read(request, queries.runs), "period_s": settings.period_s, "version": __version__}
    )


async def api_overview(request: web.Request) -> web.Response:
    run = await _run_name(request)
    return web.json_response({"run": run, "now": world.wall(), **await _read(request, queries.overview, run)})


async def api_series(request: web.Request) -> web.Response:
    run = await _run_name(request)
    points = _number(request, "points", int, 300)
    since = _number(request, "since", float, None)
    if points < 1:
        raise _error(web.HTTPBadRequest, "query parameter points must be >= 1")
    return web.json_response(
        {"run": run, **await _read(request, queries.series, run, points=points, since=since)}
    )


async def api_nodes(request: web.Request) -> web.Response:
    run = await _run_name(request)
    return web.json_response({"run": run, "nodes": await _read(request, queries.nodes, run)})


async def api_leaderboard(request: web.Request) -> web.Response:
    run = await _run_name(request)
    return web.json_response({"run": run, "accounts": await _read(request, queries.leaderboard, run)})


async def api_alerts(request: web.Request) -> web.Response:
    run = await _run_name(request)
    settings = request.app[SETTINGS_KEY]
    return web.json_response({"run": run, "alerts": await _read(request, current_alerts, run, settings)})


async def api_flags(request: web.Request) -> web.Response:
    run = await _run_name(request)
    since = _number(request, "since", float, None)
    return web.json_response({"run": run, "flags": await _read(request, queries.flags, run, since=since)})


def make_app(store: MonitorStore, settings: MonitorSettings) -> web.Application:
    """The dashboard and its API on ``store`` (which it reads, never writes)."""
    app = web.Application()
    app[STORE_KEY] = store
    app[SETTINGS_KEY] = settings
    app.add_routes(
        [
            web.get("/", index),
            web.get("/static/{name}", asset),
            web.get("/api/runs", api_runs),
            web.get("/api/runs/{run}/overview", api_overview),
            web.get("/api/runs/{run}/series", api_series),
            web.get("/api/runs/{run}/nodes", api_nodes),
            web.get("/api/runs/{run}/leaderboard", api_leaderboard),
            web.get("/api/runs/{run}/alerts", api_alerts),
            web.get("/api/runs/{run}/flags", api_flags),
        ]
    )
    return app


async def start_site(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on host:port (0: a free port); (the runner to clean up, the URL)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    return runner, f"http://{bound[0]}:{bound[1]}/"
