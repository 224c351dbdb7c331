"""Serving benchmark: an asyncio load generator (httpx + SSE) for any OpenAI-compatible server (netra-jax, vLLM,
llama.cpp's llama-server) with closed-loop concurrency sweeps, Poisson arrivals and vLLM `bench serve` metrics.

Usage: `netra-jax bench serve --base-url http://127.0.0.1:8000 --max-concurrency 1,4,16,32 --num-prompts 32
--input-len 128 --output-len 64 --ignore-eos --label ours`, then `... --plot a.json b.json --label ours llama.cpp`.
Writes --result-dir/<date>-serve_<label>.json and .png; the default directory is ./benchmarks/results when it exists
(a checkout), else ./bench-results. With `--launch [--server-args "MODEL FLAGS"]` the benchmark starts `netra-jax
serve` itself on a free port, waits for /ready, runs the sweep and stops it (netra_jax.bench.launch).

Metrics follow vLLM's definitions: TTFT is the time to the first chunk carrying text, ITL the gaps between later such
chunks, TPOT (e2e - ttft) / (output_tokens - 1) for requests with more than one token, E2E the time to the last text
chunk; output tokens come from the final usage chunk (`stream_options.include_usage`) or else the text-chunk count.
A sweep's passes each get a fresh random set (seed + pass index) so one pass cannot hit another's prefix cache (a
JSONL set is the same in every pass). Every result records the machine (netra_jax.bench.machine) and, when the
server counts speculative decoding in its /metrics, each pass's draft acceptance (netra_jax.bench.spec_metrics).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from netra_jax.bench import datasets as bd
from netra_jax.bench import plot as bench_plot
from netra_jax.bench import spec_metrics
from netra_jax.bench.machine import machine_info
from netra_jax.bench.options import parse_args, prompts_per_pass, run_config


def default_result_dir() -> Path:
    """benchmarks/results under the current directory when it exists (a checkout), else ./bench-results."""
    checkout = Path.cwd() / "benchmarks" / "results"
    return checkout if checkout.is_dir() else Path.cwd() / "bench-results"


@dataclass
class Output:
    ok: bool = False
    cut: bool = False  # cancelled at the pass's --max-duration (output_tokens: what had streamed by then)
    error: str = ""
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the usage chunk
    prompt_len: int | None = None  # from the dataset
    text: str = ""


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        d = c.get("delta") or {}
        return (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")
    return c.get("text") or ""


async def send(client: httpx.AsyncClient, url: str, body: dict, headers: dict, out: Output | None = None) -> Output:
    """One streamed request; every timestamp is taken as its SSE line arrives. `out`: the Output to fill (a pass
    keeps it, so a request cancelled midway still shows what it received)."""
    out = Output() if out is None else out
    start = last = time.perf_counter()
    chunks, parts = 0, []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if "error" in obj:
                    out.error = json.dumps(obj["error"])[:300]
                    return out
                if text := _chunk_text(obj):
                    if out.ttft is None:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    out.output_tokens = max(out.output_tokens, chunks)  # the usage chunk's count replaces it
                    parts.append(text)
                if usage := obj.get("usage"):
                    out.output_tokens = usage.get("completion_tokens") or out.output_tokens
                    out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    out.ok, out.text = True, "".join(parts)
    out.output_tokens = out.output_tokens or chunks
    out.latency = (last if chunks else time.perf_counter()) - start
    return out


def compute_metrics(outs: list[Output], duration: float, percentiles: list[float]) -> dict:
    """vLLM `bench serve` metrics over one pass; times in ms, throughputs per second of the pass."""
    ok = [o for o in outs if o.ok]
    cut = [o for o in outs if o.cut]
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.ttft is not None and o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl]
    e2el = [o.latency for o in ok]
    inp = sum(o.prompt_tokens if o.prompt_tokens is not None else (o.prompt_len or 0) for o in ok)
    outp = sum(o.output_tokens for o in ok) + sum(o.output_tokens for o in cut)
    m = {
        "completed": len(ok),
        "failed": len(outs) - len(ok) - len(cut),
        "cut": len(cut),
        "duration": duration,
        "total_input_tokens": inp,
        "total_output_tokens": outp,
        "request_throughput": len(ok) / duration,
        "output_throughput": outp / duration,
        "total_token_throughput": (inp + outp) / duration,
    }
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2el)):
        a = np.asarray(xs, dtype=np.float64) * 1000.0
        m[f"mean_{name}_ms"] = float(a.mean()) if a.size else None
        m[f"median_{name}_ms"] = float(np.median(a)) if a.size else None
        m[f"std_{name}_ms"] = float(a.std()) if a.size else None
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p)) if a.size else None
    m["errors"] = sorted({o.error for o in outs if not o.ok and not o.cut})[:5]
    return m


class Bench:
    def __init__(self, args, client: httpx.AsyncClient, model: str):
        self.a, self.client, self.model = args, client, model
        self.url = args.base_url + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def body(self, item: bd.Item, history: list[tuple[str, str]], turn: int) -> dict:
        a = self.a
        b = {
            "model": self.model,
            "max_tokens": item.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if a.temperature is not None:
            b["temperature"] = a.temperature
        if a.ignore_eos:
            b["ignore_eos"] = True
        if a.endpoint == "chat":
            msgs = item.messages
            if msgs is None:
                msgs = [{"role": "system", "content": item.system}] if item.system else []
                for u, r in history:
                    msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": r}]
                msgs.append({"role": "user", "content": item.turns[turn]})
            b["messages"] = msgs
        else:
            if item.messages is not None:
                raise SystemExit("a {'messages'} dataset line needs --endpoint chat")
            if item.system is None and not history:
                b["prompt"] = item.turns[turn]
            else:
                talk = "".join(f"User: {u}\nAssistant: {r}\n" for u, r in history)
                b["prompt"] = f"{item.system or ''}\n\n{talk}User: {item.turns[turn]}\nAssistant:"
        b.update(a.extra_body)
        return b

    async def run_item(self, item: bd.Item, sem, sink: list, bar, turns: int | None = None) -> None:
        history: list[tuple[str, str]] = []
        for t in range(turns or max(1, len(item.turns))):
            body = self.body(item, history, t)
            out = Output(prompt_len=item.prompt_lens[t] if t < len(item.prompt_lens) else None)
            if sem is None:
                sink.append(out)
                await send(self.client, self.url, body, self.headers, out)
            else:
                async with sem:
                    sink.append(out)  # once sent: a request cancelled while it waits for a slot was never sent
                    await send(self.client, self.url, body, self.headers, out)
            if bar is not None:
                bar.update(1)
            if not out.ok:
                return
            if item.turns:
                history.append((item.turns[t], out.text))

    async def run_pass(self, items: list[bd.Item], conc: int | None, rate: float, seed: int) -> dict:
        from tqdm import tqdm

        total = sum(max(1, len(i.turns)) for i in items)
        sem = asyncio.Semaphore(conc) if conc else None
        rng = np.random.default_rng(seed)
        bar = None if self.a.disable_tqdm else tqdm(total=total, desc=f"c={conc or 'all'} rate={rate:g}", leave=False)
        sink: list = []
        start = time.perf_counter()
        end = start + (self.a.max_duration or math.inf)
        tasks, due = [], start
        for item in items:
            if math.isfinite(rate) and tasks:  # Poisson (burstiness 1) or gamma-distributed gaps, as vLLM
                due += rng.gamma(self.a.burstiness, 1.0 / (rate * self.a.burstiness))
                await asyncio.sleep(max(0.0, min(due, end) - time.perf_counter()))
            if time.perf_counter() >= end:
                break
            tasks.append(asyncio.create_task(self.run_item(item, sem, sink, bar)))
        left = end - time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=left if math.isfinite(left) else None)
        for task in pending:  # the pass's time is up: cancel what is still running
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for out in sink:
            out.cut = pending != set() and not out.ok and not out.error
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
        m = compute_metrics(sink, duration, self.a.percentiles)
        head = {"max_concurrency": conc, "request_rate": rate if math.isfinite(rate) else "inf", "num_requests": total}
        return head | m

    async def warmup(self, items: list[bd.Item]) -> None:
        caps = [c for c in self.a.max_concurrency if c]
        sem = asyncio.Semaphore(min(self.a.warmup, max(caps)) if caps else self.a.warmup)
        sink: list = []
        await asyncio.gather(*(self.run_item(items[i % len(items)], sem, sink, None, 1) for i in range(self.a.warmup)))
        bad = [o.error for o in sink if not o.ok]
        print(f"warm-up: {len(sink) - len(bad)}/{len(sink)} ok" + (f"; first error: {bad[0]}" if bad else ""))


async def wait_ready(client: httpx.AsyncClient, base: str, seconds: float, headers: dict) -> None:
    """Poll until /v1/models answers and /ready (netra-jax) is 200 or absent (404)."""
    end = time.monotonic() + seconds
    while True:
        try:
            if (await client.get(base + "/v1/models", headers=headers)).status_code == 200:
                if (await client.get(base + "/ready", headers=headers)).status_code in (200, 404):
                    return
        except httpx.HTTPError:
            pass
        if time.monotonic() > end:
            raise SystemExit(f"{base} not ready after {seconds:g}s")
        await asyncio.sleep(1.0)


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30.0), limits=limits) as client:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        if args.wait_ready:
            await wait_ready(client, args.base_url, args.wait_ready, headers)
        cards = []
        try:
            r = await client.get(args.base_url + "/v1/models", headers=headers)
            cards = r.json().get("data", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            pass
        model = args.model or (cards[0]["id"] if cards else None)
        if model is None:
            raise SystemExit(f"no --model given and {args.base_url}/v1/models lists none")
        n_vocab = next(((c.get("meta") or {}).get("n_vocab") for c in cards if c.get("id") == model), None)
        maker = bd.TextMaker(client if args.dataset != "jsonl" else None, args.base_url, model, headers)
        await maker.probe(n_vocab)
        source = f"random ids < {maker.vocab} via /detokenize" if maker.vocab else "random words"
        print(f"model {model}; dataset {args.dataset}" + ("" if args.dataset == "jsonl" else f" ({source})"))
        bench = Bench(args, client, model)
        if args.warmup:
            await bench.warmup(await bd.build(args, maker, args.warmup, args.seed - 1))
        runs = []
        first = before = await spec_metrics.read(client, args.base_url, headers)  # after the warm-up
        for rate in args.request_rate:
            for conc, n in zip(args.max_concurrency, prompts_per_pass(args), strict=True):
                items = await bd.build(args, maker, n, args.seed + len(runs))
                m = await bench.run_pass(items, conc, rate, args.seed + len(runs))
                after = await spec_metrics.read(client, args.base_url, headers)
                if (spec := spec_metrics.delta(after, before)) is not None:
                    m["spec_decode"] = spec
                before = after
                runs.append(m)
                print_pass(m, args.percentiles)
    config = run_config(args) | {"model": model, "text_source": source if args.dataset != "jsonl" else "jsonl"}
    label = args.label[0] if args.label else _slug(f"{model}-{args.dataset}")
    res = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "label": label,
        "machine": machine_info(),
        "config": config,
        "runs": runs,
    }
    if (spec := spec_metrics.delta(before, first)) is not None:  # the whole sweep, warm-up left out
        res["spec_decode"] = spec
    return res


def print_pass(m: dict, percentiles: list[float]) -> None:
    ms = lambda v: "-" if v is None else f"{v:.2f}"
    print(f"\n=== max_concurrency {m['max_concurrency'] or 'all'}, request rate {m['request_rate']} ===")
    print(
        f"completed {m['completed']}  failed {m['failed']}  duration {m['duration']:.2f}s  "
        f"input {m['total_input_tokens']}  output {m['total_output_tokens']} tok"
    )
    print(
        f"throughput: {m['request_throughput']:.2f} req/s  {m['output_throughput']:.1f} output tok/s  "
        f"{m['total_token_throughput']:.1f} total tok/s"
    )
    for name in ("ttft", "tpot", "itl", "e2el"):
        ps = "  ".join(f"p{p:g} {ms(m[f'p{p:g}_{name}_ms'])}" for p in percentiles)
        print(f"{name.upper():>5} ms: mean {ms(m[f'mean_{name}_ms'])}  median {ms(m[f'median_{name}_ms'])}  {ps}")
    if (spec := m.get("spec_decode")) and spec["num_drafts"]:
        print(
            f"speculation: {spec['num_drafts']} drafts, {spec['num_accepted_tokens']}/{spec['num_draft_tokens']} "
            f"draft tokens accepted ({spec['acceptance_rate']:.1%}), mean acceptance length "
            f"{spec['mean_acceptance_length']:.2f}"
        )
    for e in m["errors"]:
        print(f"  error: {e}")


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", s).strip("-") or "run"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    today = datetime.date.today().isoformat()
    out_dir = Path(a.result_dir) if a.result_dir else default_result_dir()
    if a.plot:
        results = [json.loads(Path(f).read_text()) for f in a.plot]
        labels = a.label or [r.get("label") or Path(f).stem for r, f in zip(results, a.plot, strict=True)]
        if len(labels) != len(results):
            raise SystemExit("--label needs one name per --plot file")
        png = bench_plot.plot(results, labels, out_dir / f"{today}-serve_{_slug('_vs_'.join(labels))}.png")
        print(f"wrote {png}")
        table = bench_plot.markdown_table(results, labels)
        print(table, end="")
        if a.table:
            Path(a.table).parent.mkdir(parents=True, exist_ok=True)
            Path(a.table).write_text(table)
            print(f"wrote {a.table}")
        return 0
    if a.launch:
        from netra_jax.bench.launch import launched

        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else None
        with launched(a.server_args, timeout=a.launch_timeout, log_path=a.server_log, headers=headers) as url:
            a.base_url = url
            res = asyncio.run(run(a))
    else:
        res = asyncio.run(run(a))
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = str(out_dir / f"{today}-serve_{_slug(res['label'])}")
    Path(stem + ".json").write_text(json.dumps(res, indent=1, allow_nan=False) + "\n")
    print(f"wrote {stem}.json")
    if not a.no_plot:
        print(f"wrote {bench_plot.plot([res], [res['label']], stem + '.png')}")
    return 0 if all(r["failed"] == 0 for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
