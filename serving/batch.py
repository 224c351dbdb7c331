"""OpenAI Batch API jobs offline: run a JSONL file of /v1/chat/completions and /v1/completions requests through one
engine in a bounded window, appending OpenAI batch output lines as each request finishes (resumable)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from netra_jax.engine.spec import stats_between
from netra_jax.serving import context
from netra_jax.serving.batch_io import (
    Progress,
    Work,
    classify,
    error_line,
    load_progress,
    read_lines,
    success_line,
)
from netra_jax.serving.batch_openai import Job, RequestError, prepare, response_body
from netra_jax.serving.context import ServingContext
from netra_jax.serving.lora_modules import LoRAModule, ServedAdapters

if TYPE_CHECKING:
    from netra_jax.engine.engine import LLMEngine
    from netra_jax.engine_config import EngineConfig
    from netra_jax.serving.chat_output import ChatOutputConfig


def served_model_name(config: EngineConfig) -> str:
    """The name a request's `model` must carry: the server's rule (serving.context.served_model_name)."""
    return context.served_model_name(config.model, config.served_model_name)


# ---------------------------------------------------------------------- the engine loop
class _Runner:
    """Feeds Works to one engine, keeping at most `window` sequences in flight, and emits one output line per Work."""

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        emit: Callable[[dict], None],
        window: int,
        chat_output: ChatOutputConfig | None = None,
        chat_template: str | None = None,
        lora_modules: list[LoRAModule] | None = None,
    ):
        self.engine, self.model_name, self.emit, self.window = engine, model_name, emit, window
        adapters = ServedAdapters.loaded(engine, lora_modules)  # before the first line
        self.ctx = ServingContext.of(engine, model_name, chat_template, chat_output, adapters)
        self.jobs: dict[str, Job] = {}  # engine request id -> its job
        self.in_flight = 0
        self._next = 0

    def submit(self, work: Work) -> None:
        try:
            job = prepare(work, self.ctx)
        except RequestError as e:
            line = error_line(
                work.custom_id, str(e), e.code, line=work.line, status=e.status, param=e.param, api_code=e.api_code
            )
            self.emit(line)
            return
        try:
            while not self._add(job):  # the engine's waiting queue is at its cap: let requests finish first
                self.step()
        except ValueError as e:
            self.emit(error_line(work.custom_id, str(e), "invalid_request", line=work.line))

    def _add(self, job: Job) -> bool:
        from netra_jax.engine.scheduler import QueueFullError

        self._next += 1
        added = []
        try:
            for k, (prompt, sp) in enumerate(job.prompts):
                rid = f"batch-{self._next}.{k}"
                self.engine.add_request(rid, prompt, sp, priority=job.priority, lora_request=job.lora)
                added.append(rid)
        except (QueueFullError, ValueError):
            for rid in added:
                self.engine.abort_request(rid)
            if isinstance(sys.exc_info()[1], QueueFullError) and self.in_flight:
                return False
            raise
        job.rids = added
        for rid in added:
            self.jobs[rid] = job
        self.in_flight += job.num_seqs
        return True

    def step(self) -> None:
        if not self.engine.has_unfinished_requests():
            raise RuntimeError(f"the engine holds none of the {len(self.jobs)} batch requests in flight")
        for out in self.engine.step():
            if not out.finished or out.request_id not in self.jobs:
                continue
            job = self.jobs.pop(out.request_id)
            job.outputs[out.request_id] = out
            if len(job.outputs) < len(job.rids):
                continue
            self.in_flight -= job.num_seqs
            outs = [job.outputs[r] for r in job.rids]
            bad = [o for o in outs if o.error or any(c.finish_reason in ("error", "abort") for c in o.outputs)]
            failed = (bad[0].error or "the engine failed this request") if bad else None
            w = job.work
            if failed:
                self.emit(error_line(w.custom_id, failed, "server_error", line=w.line, status=500))
            else:
                self.emit(success_line(w.custom_id, response_body(job, outs, self.ctx)))

    def abort_all(self) -> None:
        for rid in list(self.jobs):
            self.engine.abort_request(rid)
        self.jobs.clear()


def process(
    engine: LLMEngine,
    items: Iterable[Work | dict | None],
    emit: Callable[[dict], None],
    model_name: str,
    window: int,
    chat_output: ChatOutputConfig | None = None,
    chat_template: str | None = None,
    lora_modules: list[LoRAModule] | None = None,
) -> None:
    """Run every Work through the engine (error lines pass straight to `emit`). On any exception the requests in
    flight are aborted so the engine is left idle. `chat_output`: tool-call and reasoning parsers, and `chat_template`:
    Jinja source replacing the checkpoint's, as the server's; `lora_modules`: LoRA adapters a body's `model` may name
    (the engine needs enable_lora)."""
    runner = _Runner(engine, model_name, emit, max(1, window), chat_output, chat_template, lora_modules)
    try:
        for item in items:
            if item is None:
                continue
            if isinstance(item, dict):
                emit(item)
                continue
            while runner.in_flight >= runner.window:
                runner.step()
            runner.submit(item)
        while runner.in_flight:
            runner.step()
    except BaseException:
        runner.abort_all()
        raise


# ---------------------------------------------------------------------- writing and summary
@dataclass
class BatchSummary:
    requests: int = 0  # non-blank input lines, including those already done by an earlier run
    completed: int = 0  # success lines written by this run
    errors: int = 0  # error lines written by this run
    skipped: int = 0  # lines already present in the output (resumed)
    prompt_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    speculative: dict | None = None  # speculative decoding counters of this run (netra_jax.engine.spec.stats_between)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"batch: {self.requests} requests ({self.completed} completed, {self.errors} errors, {self.skipped} "
            f"already done) in {self.seconds:.1f}s; {self.prompt_tokens} prompt + {self.output_tokens} output "
            f"tokens, {self.output_tokens_per_s:.1f} output tok/s"
        ) + _speculative_line(self.speculative)


def _speculative_line(spec: dict | None) -> str:
    if not spec:
        return ""
    return (
        f"; speculative: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} proposed tokens accepted "
        f"({spec['acceptance_rate']:.0%}), mean acceptance length {spec['mean_acceptance_length']:.2f}"
    )


class OutputWriter:
    """Appends output lines to the output file, flushing each, and keeps the counts and the progress bar."""

    def __init__(self, f, summary: BatchSummary, bar=None):
        self.f, self.s, self.bar, self.t0 = f, summary, bar, time.perf_counter()

    def emit(self, out: dict[str, Any]) -> None:
        self.f.write(json.dumps(out, ensure_ascii=False) + "\n")
        self.f.flush()
        if out["error"] is None:
            usage = out["response"]["body"]["usage"]  # a Responses body counts input and output tokens
            self.s.completed += 1
            self.s.prompt_tokens += usage["prompt_tokens"] if "prompt_tokens" in usage else usage["input_tokens"]
            self.s.output_tokens += (
                usage["completion_tokens"] if "completion_tokens" in usage else usage["output_tokens"]
            )
        else:
            self.s.errors += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self.s.output_tokens / (time.perf_counter() - self.t0):.1f} tok/s")


def count_requests(path: str | os.PathLike) -> int:
    return sum(1 for _, raw in read_lines(path) if raw.strip())


def open_job(input_path, output_path, progress: bool):
    """Shared set-up of a run: the resume state, the summary, and a progress bar over the input's requests."""
    prog = load_progress(output_path)
    summary = BatchSummary(requests=count_requests(input_path))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=summary.requests, desc="batch requests", dynamic_ncols=True)
    return prog, summary, bar


def close_job(prog: Progress, summary: BatchSummary, bar, t0: float, progress: bool) -> BatchSummary:
    summary.skipped = prog.skipped
    summary.seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if progress:
        print(summary, file=sys.stderr, flush=True)
    return summary


def run_batch(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    engine: LLMEngine | None = None,
    *,
    engine_config: EngineConfig | None = None,
    max_in_flight: int | None = None,
    model_name: str | None = None,
    progress: bool = True,
    chat_output: ChatOutputConfig | None = None,
    chat_template: str | None = None,
    lora_modules: list[LoRAModule] | None = None,
) -> BatchSummary:
    """Run an OpenAI Batch JSONL file through one engine (built from `engine_config` when `engine` is None) and
    append the results to `output_path`; custom_ids already there are skipped. `max_in_flight` bounds the
    sequences queued in the engine (default 4 * max_num_seqs)."""
    t0 = time.perf_counter()
    if engine is None:
        from netra_jax.engine.factory import build_engine
        from netra_jax.engine_config import EngineConfig

        engine = build_engine(engine_config or EngineConfig())
    name = model_name or served_model_name(engine.config)
    window = max_in_flight or 4 * engine.config.scheduler.max_num_seqs
    prog, summary, bar = open_job(input_path, output_path, progress)
    skip_bar = (lambda: bar.update(1)) if bar is not None else (lambda: None)
    spec_before = engine.spec_stats()

    def items() -> Iterator[Work | dict | None]:
        for n, raw in read_lines(input_path):
            before = prog.skipped
            item = classify(n, raw, prog)
            if prog.skipped > before:
                skip_bar()
            yield item

    try:
        with open(output_path, "a", encoding="utf-8") as f:
            emit = OutputWriter(f, summary, bar).emit
            process(engine, items(), emit, name, window, chat_output, chat_template, lora_modules)
    finally:
        if spec_before is not None:
            summary.speculative = stats_between(spec_before, engine.spec_stats())
        close_job(prog, summary, bar, t0, progress)
    return summary


# ---------------------------------------------------------------------- command line
