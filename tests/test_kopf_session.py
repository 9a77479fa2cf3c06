"""handlers.bounded_session: kopf's HTTP session with a bounded connection pool (issue 22).

kopf's own session opens as many connections as it has requests in flight
(2,000 jobs at once opened 1,205 TLS connections, 256 KiB of read buffer each).
Here 200 concurrent requests go through the session to a real local HTTP
server that counts the connections it sees at once: never more than the bound,
and every request answered, with kopf's credentials as headers.
"""

from __future__ import annotations

import asyncio

import kopf
from aiohttp import web

from videojob.controller.handlers import KOPF_CONNECTIONS, bounded_session


def test_kopfs_session_opens_at_most_its_bound_of_connections_and_answers_every_request():
    async def scenario() -> tuple[int, int, set[str], int]:
        peers: set = set()
        peak = [0]
        active = [0]
        auth: set[str] = set()

        async def handle(request: web.Request) -> web.Response:
            peers.add(request.transport.get_extra_info("peername"))
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            auth.add(request.headers.get("Authorization", ""))
            try:
                await asyncio.sleep(0.02)
            finally:
                active[0] -= 1
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_get("/x", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        info = kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}", token="secret-token")
        context = bounded_session(info, watches=2)
        session = context.aiohttp_session
        try:
            assert context.server == info.server
            assert session.connector.limit == KOPF_CONNECTIONS + 2

            async def one() -> int:
                async with session.get(f"{info.server}/x") as response:
                    await response.json()
                    return response.status

            statuses = await asyncio.gather(*(one() for _ in range(200)))
        finally:
            await session.close()
            await runner.cleanup()
        return len(peers), peak[0], auth, sum(1 for s in statuses if s == 200)

    connections, peak, auth, answered = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert answered == 200
    assert connections <= KOPF_CONNECTIONS + 2, f"{connections} connections for a bound of {KOPF_CONNECTIONS + 2}"
    assert 1 < peak <= KOPF_CONNECTIONS + 2, peak
    assert auth == {"Bearer secret-token"}, auth
