"""Prometheus metrics of one server in its own CollectorRegistry: latency histograms (TTFT, TPOT, E2E), token and
request counters, and gauges read from the engine at scrape time (queues, KV blocks, prefix-cache hit rate)."""

from __future__ import annotations

import threading
import time
from collections import deque

import jax.monitoring
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from netra_jax.engine.async_engine import AsyncEngine
from netra_jax.engine.outputs import RequestOutput
from netra_jax.engine.warmup import COMPILE_THREADS

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # every XLA compile, persistent-cache hits included


class CompileCounter:
    """XLA compilations in this process (one jax.monitoring listener, registered on first use), with the names of
    the most recent ones."""

    count = 0
    # those outside the warm-up's compile threads (`engine.warmup.compile_variants`): once a server is ready, the
    # compilations on the request path (its background compiles are not)
    outside_warmup = 0
    recent: deque[str] = deque(maxlen=32)
    _lock = threading.Lock()
    _registered = False

    @classmethod
    def install(cls) -> None:
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._registered = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == _COMPILE_EVENT:
            cls.count += 1
            name = str(kwargs.get("fun_name", "?"))
            if not threading.current_thread().name.startswith(COMPILE_THREADS):
                cls.outside_warmup += 1
                name += " (request path)"
            cls.recent.append(name)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = r = CollectorRegistry()
        self.engine = engine
        self.ttft = Histogram("netra_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r)
        self.tpot = Histogram(
            "netra_time_per_output_token_seconds", "Time per output token after the first", buckets=_TPOT, registry=r
        )
        self.e2e = Histogram("netra_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("netra_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("netra_generation_tokens", "Generated tokens", registry=r)
        self.success = Counter("netra_request_success", "Finished engine requests", ["finished_reason"], registry=r)
        self.errors = Counter("netra_request_errors", "Error responses", ["status"], registry=r)
        self.aborted = Counter("netra_request_aborted", "Engine requests aborted (client gone, error)", registry=r)
        CompileCounter.install()
        eng = engine.engine
        pool, sched = eng.pool, eng.scheduler
        gauges = {
            "netra_num_requests_running": ("Sequences running in the engine", lambda: sched.num_running),
            "netra_num_requests_waiting": ("Sequences waiting for admission", lambda: sched.num_waiting),
            "netra_num_requests_unfinished": ("Requests the server is streaming", lambda: engine.num_unfinished),
            "netra_kv_cache_usage_ratio": ("Fraction of KV blocks in use", lambda: pool.usage),
            "netra_kv_blocks_total": ("KV blocks in the pool", lambda: pool.num_total),
            "netra_kv_blocks_in_use": ("KV blocks referenced by requests", lambda: pool.num_in_use),
            "netra_kv_blocks_free": ("KV blocks free", lambda: pool.num_free),
            "netra_kv_blocks_cached": ("Free KV blocks kept for prefix hits", lambda: pool.num_cached),
            "netra_prefix_cache_hit_rate": ("Prefix-cache hit tokens / queried tokens", lambda: pool.prefix_hit_rate),
            "netra_prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix cache",
                lambda: pool.prefix_hits_tokens,
            ),
            "netra_prefix_cache_query_tokens": (
                "Prompt tokens looked up in the prefix cache",
                lambda: pool.prefix_queries_tokens,
            ),
            "netra_engine_alive": ("1 while the engine loop runs", lambda: 1.0 if engine.is_alive else 0.0),
            "netra_engine_steps": ("Engine steps run since start", lambda: engine.num_steps),
            "netra_xla_compilations": (
                "XLA compilations in this process (warm-up included)",
                lambda: CompileCounter.count,
            ),
            "netra_xla_compilations_outside_warmup": (
                "XLA compilations outside the warm-up's compile threads (after /ready: on the request path)",
                lambda: CompileCounter.outside_warmup,
            ),
            "netra_programs_pending": (
                "Programs the warm-up is still compiling in the background (0: all compiled)",
                lambda: eng.programs_pending,
            ),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, registry=r).set_function(fn)
        if eng.speculation is not None:
            self._spec_gauges(eng.speculation.stats)
        self.lora_info = None
        if eng.loras is not None:  # vLLM's vllm:lora_requests_info: the adapters in use, as labels, set at each scrape
            self.lora_info = Gauge(
                "netra_lora_requests_info",
                "LoRA adapters of running and waiting requests (labels; the value is the scrape's Unix time)",
                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
                registry=r,
            )

    def _spec_gauges(self, stats) -> None:
        """vLLM's speculative-decoding counters (cumulative since start) under the server's prefix."""
        r = self.registry
        for name, doc in (
            ("num_drafts", "Verification steps with proposed tokens"),
            ("num_draft_tokens", "Proposed tokens"),
            ("num_accepted_tokens", "Proposed tokens accepted by the target"),
        ):
            Gauge(f"netra_spec_decode_{name}", doc, registry=r).set_function(lambda n=name: getattr(stats, n))
        per_pos = Gauge(
            "netra_spec_decode_num_accepted_tokens_per_pos",
            "Accepted proposed tokens by position in the proposal (0 = first)",
            ["position"],
            registry=r,
        )
        for i in range(stats.num_speculative_tokens):
            per_pos.labels(str(i)).set_function(lambda i=i: stats.accepted_per_pos[i])

    def record(self, out: RequestOutput, aborted: bool = False) -> None:
        """Account one engine request at its end (finished, or aborted with what it had produced)."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(o.token_ids) for o in out.outputs))
        if aborted:
            self.aborted.inc()
            return
        for o in out.outputs:
            self.success.labels(o.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(max(m.ttft, 0.0))
        if m.tpot is not None:
            self.tpot.observe(max(m.tpot, 0.0))
        if m.e2e is not None:
            self.e2e.observe(max(m.e2e, 0.0))

    def count_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def render(self) -> bytes:
        if self.lora_info is not None:
            eng = self.engine.engine
            running, waiting = eng.lora_requests()
            self.lora_info.clear()
            labels = (str(eng.config.lora.max_loras), ",".join(sorted(running)), ",".join(sorted(waiting)))
            self.lora_info.labels(*labels).set(time.time())
        return generate_latest(self.registry)
