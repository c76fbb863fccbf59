"""The serving benchmark's HTTP client: events split across TCP segments, error bodies, early closes."""
import asyncio
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after the repo: benchmarks/kernels.py

from sse_client import post_streamed  # noqa: E402


def chunked(*parts: bytes) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(part), part) for part in parts] + [b"0\r\n\r\n"]


async def serve_once(pieces: list[bytes]) -> tuple[asyncio.AbstractServer, int, asyncio.Future[bytes]]:
    """A server that reads one request, then writes `pieces` one by one (a pause between them) and closes."""
    received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        received.set_result(head + await reader.readexactly(length))
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], received


def run(pieces: list[bytes]):
    async def main():
        server, port, received = await serve_once(pieces)
        async with server:
            response = await post_streamed(f"http://127.0.0.1:{port}/v1/completions", b'{"a": 1}',
                                           {"Authorization": "Bearer k"}, 5.0, 5.0)
            return response, await received
    return asyncio.run(main())


def test_events_split_anywhere_arrive_whole_in_order_with_their_arrival_times():
    stream = b'data: {"n": 1}\n\n: a comment\n\ndata: {"n": 2}\n\nevent: x\ndata: {"n": 3}\n\ndata: [DONE]\n\n'
    # Chunk boundaries in the middle of an event, a line and the blank line that ends an event.
    parts = [stream[:7], stream[7:16], stream[16:40], stream[40:61], stream[61:]]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    response, request = run([head, *chunked(*parts)])
    assert response.status == 200
    assert [payload for _, payload in response.events] == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}', b"[DONE]"]
    times = [arrival for arrival, _ in response.events]
    assert times == sorted(times) and times[0] < times[-1]  # stamped when their last byte came, not at the end
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer k\r\n" in request and request.endswith(b'\r\n\r\n{"a": 1}')


def test_an_error_status_keeps_its_body_and_no_events():
    body = b'{"error": {"message": "bad", "type": "invalid_request_error", "param": null, "code": null}}'
    head = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
    response, _ = run([head, body[:10], body[10:]])
    assert (response.status, response.body, response.events) == (400, body, [])


def test_a_connection_closed_mid_stream_raises():
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    with pytest.raises(ConnectionError):
        run([head, *chunked(b'data: {"n": 1}\n\n')[:1]])
