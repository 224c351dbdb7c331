"""A lean streaming client for host-overhead measurements: raw asyncio sockets, no HTTP library, so its own CPU per
event is small; records the monotonic arrival time of every SSE event. Reads a JSON spec on stdin, prints JSON.

Spec: {"host", "port", "path", "concurrency", "bodies": [JSON request bodies]}; closed loop, `concurrency` requests
in flight. Output: {"wall_s", "cpu_s", "requests": [{"index", "start", "events": [times]}]}. Times are
`time.monotonic()`, the same clock in every process of the machine, so they compare with the server's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

EVENT = b"data: {"


async def stream(host: str, port: int, path: str, body: bytes) -> list[float]:
    """POST one streaming request; the arrival time of each `data: {...}` event (not the final `data: [DONE]`)."""
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head + body)
    await writer.drain()
    times: list[float] = []
    tail, done = b"", False
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.monotonic()
        seen = tail + data
        times.extend([now] * seen.count(EVENT))
        done = done or b"data: [DONE]" in seen
        tail = seen[-12:].replace(EVENT, b"")  # a marker split over two reads is counted once
    writer.close()
    if not done:
        raise RuntimeError(f"{path}: the stream ended without data: [DONE] after {len(times)} events")
    return times


async def run(spec: dict) -> dict:
    pending = list(enumerate(spec["bodies"]))
    results: list[tuple[int, float, list[float]]] = []

    async def worker() -> None:
        while pending:
            i, body = pending.pop(0)
            start = time.monotonic()
            results.append((i, start, await stream(spec["host"], spec["port"], spec["path"], body.encode())))

    c0, t0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
    return {
        "wall_s": time.monotonic() - t0,
        "cpu_s": time.process_time() - c0,
        "requests": [{"index": i, "start": s, "events": ev} for i, s, ev in sorted(results)],
    }


def main() -> int:
    print(json.dumps(asyncio.run(run(json.loads(sys.stdin.read())))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
