"""A loopback HTTP proxy that records what a client sends and what it gets back, for replaying a benchmark client's
exact requests in a test (tests/test_bench_clients.py, fixtures in tests/data/bench_clients/).

    python scripts/record_proxy.py --listen-port P --upstream http://127.0.0.1:8000 --out requests.jsonl

Each line of --out: {"method", "path", "body" (JSON or null), "status", "events" (a stream's `data:` payloads, in
order; a whole reply's body as one event)}, except GET /metrics. Streams are passed through as they come, so the
client's timing holds.
Stop it with SIGTERM / SIGINT.
"""
from __future__ import annotations

import argparse
import json

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

HOP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


def make_app(upstream: str, out_path: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=None)
    out = open(out_path, "a", encoding="utf-8")  # noqa: SIM115 - open for the proxy's life

    def record(entry: dict) -> None:
        out.write(json.dumps(entry) + "\n")
        out.flush()

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def proxy(path: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        req = client.build_request(request.method, "/" + path, content=raw, headers=headers,
                                   params=request.query_params)
        resp = await client.send(req, stream=True)
        entry = {"method": request.method, "path": "/" + path, "body": body, "status": resp.status_code,
                 "events": []}
        kind = resp.headers.get("content-type", "")
        if kind.startswith("text/event-stream"):
            async def relay():
                buf = ""
                try:
                    async for chunk in resp.aiter_text():
                        yield chunk
                        buf += chunk
                        *lines, buf = buf.split("\n")
                        entry["events"] += [line[6:] for line in lines if line.startswith("data: ")]
                finally:
                    await resp.aclose()
                    record(entry)
            return StreamingResponse(relay(), status_code=resp.status_code, media_type=kind)
        data = await resp.aread()
        await resp.aclose()
        if path != "metrics":  # Prometheus scrapes (AIPerf polls it all run long) are passed on, not recorded
            entry["events"] = [data.decode("utf-8", "replace")]
            record(entry)
        return Response(data, status_code=resp.status_code, media_type=kind or None)

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", required=True, help="JSON-lines file to append the exchanges to")
    args = p.parse_args()
    uvicorn.run(make_app(args.upstream, args.out), host="127.0.0.1", port=args.listen_port, log_level="warning")


if __name__ == "__main__":
    main()
