"""Per-token host overhead of streamed serving: where the time between the engine's step and the client's SSE chunk
goes at 1 and 8 users, on the default model (SmolLM2-135M-Instruct, float32), through the real app and uvicorn.

Usage: `.venv/bin/python -m benchmarks.step_profile host [--model PATH] [--users 1 8] [--requests 4 16]
[--input-len 128] [--output-len 128] [--endpoint completions|chat] [--repeats 3] [--label L] [--profile DIR]`.
Writes benchmarks/results/<date>-host_overhead[_<label>].json and prints a line per concurrency.

The server runs in this process as `netra-jax serve` runs it (AsyncEngine thread, FastAPI app under uvicorn, the
serve command's engine defaults, async scheduling on); a lean raw-socket client (benchmarks/sse_client.py) streams
from another process. Per concurrency, medians over `--repeats` interleaved rounds of:
- `tpot_ms`: the client's time per output token through the server;
- `engine_tpot_ms`: the same number of requests run by the engine alone (its own thread, no server, no client);
- `model_ms`: a decode step of that batch replayed alone (forward + sampler dispatched back to back);
so `overhead_ms = tpot_ms - model_ms` = `server_ms` (tpot - engine_tpot: asyncio hops, pydantic/JSON, SSE, uvicorn,
the client) + `engine_loop_ms` (engine_tpot - model: schedule, pack, sampling rows, detokenize, outputs).
Also: `engine_host_ms` (a decode step's wall time not spent blocked on the device), `send_lag_ms` (end of the step
that made a token -> its SSE chunk handed to uvicorn), `recv_lag_ms` (1 user: that hand-over -> the client's read),
and `cpu_ms_per_token` of the event-loop thread, the engine thread (of which `forward_dispatch`: XLA launching the
forward, ~300 argument buffers and its thunks), the other threads (XLA's compute) and the client, from /proc's
schedstat: CPU time depends far less than wall time on how busy the machine is.
`--profile DIR`: one more, untimed pass under yappi (`pip install yappi`), CPU time per function of the engine and
event-loop threads written to DIR. On a shared machine wall times are noisy: compare A/B runs interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import io
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import sse_client
from benchmarks.step_profile import common


class Probe:
    """Records every engine step (start, end, device wait) and the time the app hands each SSE chunk to uvicorn."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple[float, float, float]] = []
        self.sends: list[tuple[float, int]] = []  # (time, events in the chunk)
        self.decode_steps: dict[int, object] = {}  # sequences -> the latest all-decode step of that batch
        self.dispatch_cpu = 0.0  # CPU seconds of the engine thread inside the forward's jitted call (XLA's launch)
        real, dispatch = engine.step, engine.runner._dispatch

        def timed_dispatch(*args):
            c0 = time.thread_time()
            try:
                return dispatch(*args)
            finally:
                self.dispatch_cpu += time.thread_time() - c0

        engine.runner._dispatch = timed_dispatch

        def step():
            w0, t0 = engine.device_wait_s, time.monotonic()
            out = real()
            self.steps.append((t0, time.monotonic(), engine.device_wait_s - w0))
            cur = engine._in_flight
            if cur is not None and cur.run.batch.num_tokens == cur.run.batch.num_seqs:
                self.decode_steps[cur.run.batch.num_seqs] = cur
            return out

        engine.step = step

    def wrap(self, app):
        async def asgi(scope, receive, send):
            async def timed_send(msg):
                if msg["type"] == "http.response.body":
                    n = msg.get("body", b"").count(b"data: {")
                    if n:
                        self.sends.append((time.monotonic(), n))
                await send(msg)

            await app(scope, receive, timed_send)

        return asgi

    def clear(self) -> None:
        self.steps.clear()
        self.sends.clear()


def thread_cpu() -> dict[int, float]:
    """Seconds on CPU of every thread of this process, by native thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except OSError:
            continue
    return out


def ms(xs) -> float | None:
    xs = list(xs)
    return round(1e3 * statistics.median(xs), 3) if xs else None


def replay_model_ms(engine, step, repeats: int = 20) -> float:
    """Median time of the model alone for `step`'s batch: its packed batch and sampling arrays dispatched back to
    back, nothing else on the host. Run between passes (it rewrites those KV slots, which no request holds then)."""
    import jax
    import numpy as np

    from netra_jax.ops import sampling

    runner, pb, batch = engine.runner, step.run.batch, step.batch
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        logits = runner._dispatch(pb.host, pb.shape, None)[0]  # (logits, prompt logprobs, records)
        out = sampling.sample(logits, batch.arrays, key=batch.key)
        if runner.overlap:
            jax.block_until_ready(runner.widen(out.token_ids))
        np.asarray(out.token_ids)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[2:])


def engine_tpot(engine, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """Median time per output token of `prompts` run together by the engine alone (call it in the engine thread)."""
    from netra_jax import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, sp)
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.monotonic()
        for o in outs:
            first.setdefault(o.request_id, now)
            last[o.request_id] = (now, len(o.outputs[0].token_ids))
    return statistics.median((t - first[r]) / (n - 1) for r, (t, n) in last.items() if n > 1)


def make_prompts(a, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = min(100, a.vocab_size // 4), min(40000, a.vocab_size)  # ordinary tokens, not the special ones
    return [[rng.randrange(low, high) for _ in range(a.input_len)] for _ in range(n)]


def bodies(a, tok, prompts: list[list[int]]) -> list[str]:
    """Streaming request bodies: greedy, `output_len` tokens, no usage chunk."""
    common = {"model": "m", "max_tokens": a.output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    if a.endpoint == "chat":
        return [json.dumps({**common, "messages": [{"role": "user", "content": tok.decode(p)}]}) for p in prompts]
    return [json.dumps({**common, "prompt": p}) for p in prompts]


def run_client(port: int, path: str, concurrency: int, request_bodies: list[str]) -> dict:
    spec = {"host": "127.0.0.1", "port": port, "path": path, "concurrency": concurrency, "bodies": request_bodies}
    p = subprocess.run([sys.executable, sse_client.__file__], input=json.dumps(spec), capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"client failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def served_pass(a, probe: Probe, port: int, users: int, prompts, tok, tids: dict[str, int]) -> dict:
    """One closed-loop pass through the server at `users` concurrent streams."""
    probe.clear()
    cpu0, dispatch0 = thread_cpu(), probe.dispatch_cpu
    res = run_client(port, a.path, users, bodies(a, tok, prompts))
    cpu1, dispatch = thread_cpu(), probe.dispatch_cpu - dispatch0
    skip = 1 if a.endpoint == "chat" else 0  # chat opens each choice with a role chunk
    reqs = [(r["start"], r["events"][skip:]) for r in res["requests"]]
    tokens = sum(len(ev) for _, ev in reqs)
    decoding = max(ev[0] for _, ev in reqs[:users])  # from here the first `users` requests all decode
    decode = [s for s in probe.steps if s[0] > decoding]
    ends = sorted(s[1] for s in probe.steps)
    lags = []
    for t, _ in probe.sends:
        i = bisect.bisect_right(ends, t)
        if i:
            lags.append(t - ends[i - 1])
    row = {
        "tpot_ms": ms((ev[-1] - ev[0]) / (len(ev) - 1) for _, ev in reqs if len(ev) > 1),
        "ttft_ms": ms(ev[0] - start for start, ev in reqs if ev),
        "out_tok_s": round(tokens / res["wall_s"], 2),
        "engine_step_ms": ms(e - s for s, e, _ in decode),
        "engine_host_ms": ms(e - s - w for s, e, w in decode),
        "send_lag_ms": ms(lags),
    }
    if users == 1:
        sent = [t for t, k in probe.sends for _ in range(k)][skip:]
        got = [t for _, ev in reqs for t in ev]
        row["recv_lag_ms"] = ms(r - s for s, r in zip(sent, got, strict=False))
    delta = {k: cpu1.get(k, 0.0) - v for k, v in cpu0.items()}
    loop, eng = delta.get(tids["loop"], 0.0), delta.get(tids["engine"], 0.0)
    per = 1e3 / max(tokens, 1)
    row["cpu_ms_per_token"] = {
        "event_loop": round(loop * per, 3),
        "engine_thread": round(eng * per, 3),
        "forward_dispatch": round(dispatch * per, 3),  # part of engine_thread: XLA launching the forward
        "other_threads": round((sum(delta.values()) - loop - eng) * per, 3),
        "client": round(res["cpu_s"] * per, 3),
    }
    return row


def level(a, probe, engine, ae, holder, users: int, n: int, tok) -> dict:
    """Every figure at one concurrency: `repeats` rounds of (served pass, engine-alone pass, model replay)."""
    port, tids = holder["port"], {"loop": holder["loop_tid"], "engine": ae._thread.native_id}

    def in_engine(fn):  # run fn(engine) in the engine thread, between steps
        return asyncio.run_coroutine_threadsafe(ae.call(fn), holder["loop"]).result()

    t = time.perf_counter()
    served_pass(a, probe, port, users, make_prompts(a, users, 999), tok, tids)  # compiles this level's buckets
    in_engine(lambda e: engine_tpot(e, make_prompts(a, users, 998), 8, f"warm{users}"))
    print(f"{users} users: warm-up {time.perf_counter() - t:.1f}s", flush=True)
    rounds = []
    for r in range(a.repeats):
        row = served_pass(a, probe, port, users, make_prompts(a, n, 100 * users + r), tok, tids)
        prompts = make_prompts(a, users, 50 + 100 * users + r)
        alone = in_engine(lambda e, p=prompts, tag=f"alone{users}-{r}": engine_tpot(e, p, a.output_len, tag))
        row["engine_tpot_ms"] = round(1e3 * alone, 3)
        row["model_ms"] = round(in_engine(lambda e: replay_model_ms(e, probe.decode_steps[users])), 3)
        rounds.append(row)
    out = {"users": users, "requests": n}
    for k, v in rounds[0].items():
        if isinstance(v, dict):
            out[k] = {kk: round(statistics.median(x[k][kk] for x in rounds), 3) for kk in v}
        elif v is not None:
            out[k] = round(statistics.median(x[k] for x in rounds if x[k] is not None), 3)
    out["overhead_ms"] = round(out["tpot_ms"] - out["model_ms"], 3)
    out["server_ms"] = round(out["tpot_ms"] - out["engine_tpot_ms"], 3)
    out["engine_loop_ms"] = round(out["engine_tpot_ms"] - out["model_ms"], 3)
    out["rounds"] = rounds
    if a.profile:
        profile_pass(a, probe, holder, ae, users, n, tok, tids)
    return out


def profile_pass(a, probe, holder, ae, users, n, tok, tids) -> None:
    """An untimed pass under yappi (CPU clock): per-function time of the engine and event-loop threads."""
    import yappi

    yappi.set_clock_type("cpu")
    yappi.start()
    served_pass(a, probe, holder["port"], users, make_prompts(a, n, 7), tok, tids)
    yappi.stop()
    where = Path(a.profile)
    where.mkdir(parents=True, exist_ok=True)
    contexts = {t.tid: t.id for t in yappi.get_thread_stats()}  # threading ident -> yappi's context id
    for name, ident in (("event_loop", holder["loop_ident"]), ("engine", ae._thread.ident)):
        if ident not in contexts:
            continue
        text = io.StringIO()
        stats = yappi.get_func_stats(filter={"ctx_id": contexts[ident]})
        for order in ("tsub", "ttot"):
            columns = {0: ("name", 110), 1: ("ncall", 10), 2: ("tsub", 8), 3: ("ttot", 8)}
            stats.sort(order).print_all(out=text, columns=columns)
        path = where / f"{a.label or 'run'}-{users}users-{name}.txt"
        path.write_text(text.getvalue())
        print(f"wrote {path}", flush=True)
    yappi.clear_stats()


def serve(app, holder: dict) -> None:
    """uvicorn in this (main) thread, as `netra-jax serve` runs it; `holder` gets the server, port and loop."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            holder.update(
                port=self.servers[0].sockets[0].getsockname()[1],
                loop=asyncio.get_running_loop(),
                loop_tid=threading.get_native_id(),
                loop_ident=threading.get_ident(),
            )
            holder["started"].set()

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="off")
    holder["server"] = Server(config)
    holder["server"].run()


def print_row(r: dict) -> None:
    c = r["cpu_ms_per_token"]
    print(
        f"{r['users']:2d} users: TPOT {r['tpot_ms']} ms = model {r['model_ms']} + engine loop {r['engine_loop_ms']}"
        f" + server {r['server_ms']} (overhead {r['overhead_ms']}) | step host {r['engine_host_ms']} ms,"
        f" send lag {r['send_lag_ms']}, recv lag {r.get('recv_lag_ms')} | CPU ms/token: loop {c['event_loop']},"
        f" engine {c['engine_thread']} (forward dispatch {c['forward_dispatch']}), other {c['other_threads']},"
        f" client {c['client']} | {r['out_tok_s']} tok/s",
        flush=True,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    common.add_options(p, repeats=3)
    p.add_argument("--users", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, nargs="+", default=None, help="per pass, one per --users (default 2x)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--label", default="", help="names the result file and is kept in it (e.g. before, after)")
    p.add_argument("--profile", default=None, help="directory for yappi profiles of one extra pass")


def run(a: argparse.Namespace) -> int:
    a.path = "/v1/chat/completions" if a.endpoint == "chat" else "/v1/completions"
    requests = a.requests or [2 * u for u in a.users]
    if len(requests) != len(a.users):
        raise common.OptionError("--requests needs one count per --users")

    from netra_jax.engine.async_engine import AsyncEngine
    from netra_jax.serving.app import create_app

    record = common.Run("host_overhead")
    llm = common.build_llm(a.model, warmup=False)  # `netra-jax serve`'s engine defaults; buckets compile on use
    engine = llm.engine
    engine.ready = True
    a.vocab_size = engine.vocab_size
    probe = Probe(engine)
    ae = AsyncEngine(engine)
    holder: dict = {"started": threading.Event()}
    results: list[dict] = []

    def drive() -> None:
        holder["started"].wait()
        try:
            for users, n in zip(a.users, requests, strict=True):
                results.append(level(a, probe, engine, ae, holder, users, n, llm.get_tokenizer()))
                print_row(results[-1])
        finally:
            holder["server"].should_exit = True

    threading.Thread(target=drive, name="bench-driver", daemon=True).start()
    serve(probe.wrap(create_app(ae, "m")), holder)
    ae.shutdown()
    if len(results) != len(a.users):
        print("error: the measurement did not finish", file=sys.stderr)
        return 1
    doc = record.record(
        label=a.label,
        model=common.model_label(a.model),
        dtype="float32",
        endpoint=a.endpoint,
        input_len=a.input_len,
        output_len=a.output_len,
        repeats=a.repeats,
        results=results,
    )
    record.write(doc, a.out, a.label)
    return 0
