"""AsyncEngine: runs the LLMEngine step loop in its own thread and hands each request's outputs to its asyncio
sink (one event-loop wake-up per step for all of them), so an HTTP server can `async for` over a generation and abort
it when the client leaves; a step watchdog."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from netra_jax.engine.engine import LLMEngine, PromptType
from netra_jax.engine.outputs import RequestOutput
from netra_jax.lora_request import LoRARequest
from netra_jax.models.hooks import Hooks
from netra_jax.sampling_params import SamplingParams

log = logging.getLogger(__name__)


FAULT_ENV = "NETRA_JAX_FAULT_STEP"  # test-only fault injection: "N" raises in step N, "N:hang" blocks step N


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; requests cannot be served."""


class StepTimeoutError(RuntimeError):
    """A step ran longer than the watchdog's `step_timeout`."""


class InjectedFault(RuntimeError):
    """Raised by the step chosen with NETRA_JAX_FAULT_STEP."""


def _fault_from_env() -> tuple[int, str] | None:
    raw = os.environ.get(FAULT_ENV, "").strip()
    if not raw:
        return None
    step, _, kind = raw.partition(":")
    if not step.isdigit() or kind not in ("", "raise", "hang"):
        raise ValueError(f"{FAULT_ENV}={raw!r}: expected N, N:raise or N:hang")
    return int(step), kind or "raise"


# Receives a request's outputs in order, then possibly one exception (the engine failed); called in the event loop.
Sink = Callable[[RequestOutput | BaseException], None]


@dataclass
class _Cmd:
    kind: str  # "add" | "abort" | "call"
    request_id: str
    prompt: PromptType | None = None
    params: SamplingParams | None = None
    reply: asyncio.Future | None = None
    sink: Sink | None = None
    loop: asyncio.AbstractEventLoop | None = None
    fn: Callable[[LLMEngine], Any] | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None
    hooks: Hooks | None = None


class AsyncEngine:
    """Thread-safe front of an LLMEngine. `generate()` validates in the engine thread (so errors surface as
    ValueError to the caller before any output), then yields RequestOutputs; leaving the iterator aborts the request
    and frees its KV blocks. A step that raises fails every in-flight request and marks the engine dead; so does a
    step running longer than `step_timeout` seconds (a watchdog thread fails the clients; the stuck thread is left)."""

    def __init__(self, engine: LLMEngine, step_timeout: float | None = None):
        self.engine = engine
        self._cmds: queue.SimpleQueue[_Cmd] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, Sink]] = {}
        self._wake = threading.Event()
        self._lock = threading.Lock()  # orders commands against the loop's death
        self._stop = threading.Event()
        self.dead: BaseException | None = None
        self.step_timeout = step_timeout
        self.last_step_start: float | None = None  # set while a step runs (for a watchdog)
        self.num_steps = 0
        self._fault = _fault_from_env()
        self._thread = threading.Thread(target=self._loop, name="netra-engine", daemon=True)
        self._thread.start()
        if step_timeout:
            threading.Thread(target=self._watchdog, name="netra-watchdog", daemon=True).start()

    # ------------------------------------------------------------------ public API
    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive() and not self._step_hung()

    def _step_hung(self) -> bool:
        start = self.last_step_start
        return bool(self.step_timeout and start is not None and time.monotonic() - start > self.step_timeout)

    @property
    def loop_running(self) -> bool:
        """The engine thread has not returned (it may be stuck in a step after the watchdog gave up on it)."""
        return self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._sinks)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        hooks: Hooks | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come. `priority` (vLLM's): smaller is served first under
        `--scheduling-policy priority`; a non-zero value under fcfs is a ValueError, as any bad input.
        `lora_request`: the LoRA adapter it runs with; `hooks`: interventions on its tokens, run beside the other
        requests (see `LLMEngine.add_request`)."""
        out_q: asyncio.Queue = asyncio.Queue()
        await self.submit(prompt, params, request_id, out_q.put_nowait, priority, lora_request, hooks)
        finished = False
        try:
            while True:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def submit(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        sink: Sink,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        hooks: Hooks | None = None,
    ) -> None:
        """Admit a request whose outputs go to `sink(output)`, called in this event loop's thread, in order; then,
        if the engine fails before the request finishes, `sink(EngineDeadError)`. Returns once the engine took the
        request (raises its ValueError for bad input, before any output). The caller aborts a request it stops
        reading; a request cancelled while being admitted is aborted here."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        with self._lock:
            if self.dead is not None or not self._thread.is_alive():
                raise EngineDeadError(f"engine is not running: {self.dead!r}")
            cmd = _Cmd(
                "add",
                request_id,
                prompt,
                params,
                reply,
                sink,
                loop,
                priority=priority,
                lora_request=lora_request,
                hooks=hooks,
            )
            self._send(cmd)
        try:
            await reply  # raises the engine's ValueError for bad input
        except asyncio.CancelledError:  # the caller left while the request was being admitted
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        self._send(_Cmd("abort", request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`fn(engine)` run in the engine thread between steps (consistent reads of scheduler and pool state)."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        with self._lock:
            if self.dead is not None or not self._thread.is_alive():
                raise EngineDeadError(f"engine is not running: {self.dead!r}")
            self._send(_Cmd("call", "", reply=reply, loop=loop, fn=fn))
        return await reply

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _send(self, cmd: _Cmd) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the client's loop is closed
            pass

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd.kind == "abort":
                if self._sinks.pop(cmd.request_id, None) is not None:
                    self.engine.abort_request(cmd.request_id)
                continue
            if cmd.kind == "call":
                try:
                    self._post(cmd.loop, _set_result, cmd.reply, cmd.fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    self._post(cmd.loop, _set_exc, cmd.reply, e)
                continue
            try:
                self.engine.add_request(
                    cmd.request_id,
                    cmd.prompt,
                    cmd.params,
                    priority=cmd.priority,
                    lora_request=cmd.lora_request,
                    hooks=cmd.hooks,
                )
            except Exception as e:  # bad input: the caller gets the exception, the engine is unchanged
                self._post(cmd.loop, _set_exc, cmd.reply, e)
                continue
            self._sinks[cmd.request_id] = (cmd.loop, cmd.sink)
            self._post(cmd.loop, _set_result, cmd.reply, None)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set() and self.dead is None:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self.last_step_start = time.monotonic()
                if self._fault is not None and self.num_steps + 1 == self._fault[0]:
                    self._inject(self._fault[1])
                outputs = self.engine.step()
                self.last_step_start = None
                if self.dead is not None:  # the watchdog gave up on this step; its clients have their error
                    break
                self.num_steps += 1
                if outputs:
                    self._deliver(outputs)
        except BaseException as e:  # a failed step: fail everything in flight, never hang a client
            log.error("engine step failed; failing %d requests:\n%s", len(self._sinks), traceback.format_exc())
            self.last_step_start = None
            self._fail(e, f"engine step failed: {e!r}")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their sinks: one call into each event loop for all of its requests (a wake-up
        per step, not per request)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}
        for out in outputs:
            target = self._sinks.get(out.request_id)
            if target is None:
                continue
            loop, sink = target
            by_loop.setdefault(loop, []).append((sink, out))
            if out.finished:
                del self._sinks[out.request_id]
        for loop, items in by_loop.items():
            self._post(loop, _feed, items)

    def _inject(self, kind: str) -> None:
        step = self.num_steps + 1
        log.warning("%s: injecting a %s fault into step %d", FAULT_ENV, kind, step)
        if kind == "hang":
            while not self._stop.wait(3600):
                pass
        raise InjectedFault(f"injected fault in step {step}")

    def _watchdog(self) -> None:
        period = min(1.0, self.step_timeout / 4)
        while not self._stop.wait(period) and self.dead is None:
            start = self.last_step_start
            if start is None or time.monotonic() - start <= self.step_timeout:
                continue
            msg = (
                f"engine step {self.num_steps + 1} has run for {time.monotonic() - start:.1f}s "
                f"(step timeout {self.step_timeout:g}s)"
            )
            log.error("%s; failing %d requests", msg, len(self._sinks))
            self._fail(StepTimeoutError(msg), msg)
            return

    def _fail(self, cause: BaseException, message: str) -> None:
        """Mark the engine dead, then fail every in-flight request and every queued command with EngineDeadError."""
        with self._lock:
            if self.dead is None:
                self.dead = cause
        err = EngineDeadError(message)
        for loop, sink in list(self._sinks.values()):
            self._post(loop, sink, err)
        self._sinks.clear()
        while True:  # reject commands that raced with the failure
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd.reply is not None:
                self._post(cmd.loop, _set_exc, cmd.reply, err)


def _feed(items: list[tuple[Sink, RequestOutput]]) -> None:
    for sink, out in items:
        try:
            sink(out)
        except Exception:  # one broken consumer must not starve the others of this step's outputs
            log.exception("output sink of request %s failed", out.request_id)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
