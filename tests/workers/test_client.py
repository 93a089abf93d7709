"""The engine client against a server that closes idle keep-alive connections, as SGLang's uvicorn does."""

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest

from workers.engines.client import EngineClient


async def closing_server(idle_close_s: float):
    """An HTTP/1.1 server that keeps connections alive but drops any that stay idle `idle_close_s`,
    closing without an answer if a request arrives on one it has already decided to drop
    (the race a pooled connection loses against uvicorn's keep-alive timeout)."""
    served = []

    async def handle(reader, writer):
        while True:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle_close_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError):
                break
            length = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), b"0"))
            await reader.readexactly(length)
            served.append(head.split(b" ")[1].decode())
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                         b"Connection: keep-alive\r\n\r\n{}")
            await writer.drain()
            # Decide to drop the connection now, but close it only a moment later: a request sent in
            # between meets a socket that is going away.
            await asyncio.sleep(idle_close_s)
            break
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, served


@contextlib.asynccontextmanager
async def serving(routes: dict):
    """An aiohttp server on a free loopback port with POST `routes` ({path: handler}); yields (runner, url)."""
    from aiohttp import web

    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


@pytest.mark.timeout(60)
def test_no_call_goes_out_on_a_connection_the_server_is_closing():
    async def main():
        server, served = await closing_server(idle_close_s=0.3)
        port = server.sockets[0].getsockname()[1]
        async with server:
            url = f"http://127.0.0.1:{port}"
            async with EngineClient(url) as client:
                for i in range(4):  # pauses longer than the server's patience, shorter than aiohttp's pool
                    await client.post("/update_weights_from_tensor", {"bucket": i})
                    await asyncio.sleep(0.1)
            # The same calls through a default pooled aiohttp session fail: the test can tell.
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.ClientError):
                    for i in range(4):
                        async with session.post(f"{url}/update_weights_from_tensor", json={"bucket": i}) as reply:
                            await reply.read()
                        await asyncio.sleep(0.1)
        return served
    served = asyncio.run(main())
    assert served[:4] == ["/update_weights_from_tensor"] * 4


@pytest.mark.timeout(60)
def test_a_failed_push_reports_its_first_error_not_the_session_clean_up():
    """The scheduler died on a bucket: /end_weight_update fails too, and must not hide why."""
    import torch
    from aiohttp import web

    from workers.engines.rank_engine import RankEngine
    from workers.engines.weights import WeightPusher

    async def begin(request):
        return web.json_response({"success": True})

    async def update(request):
        return web.json_response({"error": {"message": "AuthenticationError: digest sent was rejected"}}, status=400)

    async def end(request):
        return web.Response(status=503, text="scheduler is gone")

    def push(url):  # the job's handle runs its own event loop: in a thread beside this test's server
        with RankEngine(url, Path("engine.log"), WeightPusher(torch.float32), 1e-3) as engine:
            engine.push([("w", torch.ones(4))], 1, None, None)

    async def main():
        routes = {"/begin_weight_update": begin, "/update_weights_from_tensor": update, "/end_weight_update": end}
        async with serving(routes) as (_, url):
            with pytest.raises(RuntimeError) as err:
                await asyncio.to_thread(push, url)
        return err.value
    error = asyncio.run(main())
    assert "/update_weights_from_tensor" in str(error) and "digest sent was rejected" in str(error)
    assert "scheduler is gone" not in str(error) and "engine.log" in str(error)


@pytest.mark.timeout(60)
def test_calls_share_kept_alive_connections_and_a_connection_closed_under_a_call_is_retried_once():
    """A batch's requests must not each pay a connect; a pooled connection the server dropped while idle
    is the one case where a call is sent again (the server never read it)."""
    from aiohttp import web

    client_ports, served = set(), []

    async def generate(request):
        client_ports.add(request.transport.get_extra_info("peername")[1])  # one port per connection
        served.append(await request.json())
        return web.json_response({"ok": True})

    async def main():
        async with serving({"/generate": generate}) as (runner, url), EngineClient(url) as client:
            for i in range(10):
                await client.post("/generate", {"i": i})
            in_a_row = len(client_ports)
            await asyncio.gather(*(client.post("/generate", {"i": 10 + i}) for i in range(20)))
            for protocol in list(runner.server.connections):  # the server drops every idle connection
                protocol.transport.abort()
            await asyncio.sleep(0)
            await client.post("/generate", {"i": 30})
        return in_a_row

    in_a_row = asyncio.run(main())
    assert in_a_row == 1  # ten calls one after another: one connection
    assert len(client_ports) <= 22  # twenty at once: at most one each, then one more after the drop
    assert sorted(body["i"] for body in served) == list(range(31))  # each call served exactly once


@pytest.mark.timeout(60)
def test_bodies_arrive_as_sent_and_answers_read_as_written_whatever_json_they_hold():
    """The client writes bodies with orjson, and with json what orjson refuses (an integer past 64 bits); it reads
    SGLang's answers (orjson's: NaN as null), plain json's (NaN as a bare word) and text alike."""
    import json

    from aiohttp import web

    received = []

    async def echo(request):
        received.append(json.loads(await request.read()))
        return web.Response(text=json.dumps({"logprobs": [float("nan"), -0.5]}), content_type="application/json")

    async def text(request):
        return web.Response(text="Cache flushed.")

    async def main():
        async with serving({"/echo": echo, "/flush_cache": text}) as (_, url), EngineClient(url) as client:
            answers = [await client.post("/echo", body) for body in
                       ({"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0.7, "sampling_seed": 2 ** 70}},
                        {"input_ids": [4], "text": "é \u2028 \x00"})]
            return answers, await client.post("/flush_cache")

    answers, flushed = asyncio.run(main())
    assert received == [{"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0.7, "sampling_seed": 2 ** 70}},
                        {"input_ids": [4], "text": "é \u2028 \x00"}]
    assert all(answer["logprobs"][1] == -0.5 and answer["logprobs"][0] != answer["logprobs"][0] for answer in answers)
    assert flushed == "Cache flushed."
