"""`netra-jax serve`: its flags, and the start-up sequence — load the model, open the port at once (/health answers,
/ready says 503) while every step bucket compiles, then serve; SIGTERM drains and exits 0, a dead engine exits 3."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 4 << 20
ENGINE_DEAD_EXIT = 3  # exit status once the engine loop has died (a supervisor restarts the process)
DEAD_GRACE_S = 2.0  # after the engine dies: seconds of 503s (/health included) before the process exits


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; the ready line shows it)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("NETRA_JAX_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health (env NETRA_JAX_API_KEY)",
    )
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY, help="request body cap (413 above)")
    p.add_argument(
        "--cors-origins", default=None, help="comma-separated origins allowed by CORS, or '*' (default: CORS off)"
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds in-flight requests may take to finish after SIGTERM"
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=None,
        help="watchdog: a step running longer than this (seconds) kills the engine (off)",
    )
    p.add_argument(
        "--allowed-model-root",
        default=os.environ.get("NETRA_JAX_ALLOWED_MODEL_ROOT"),
        help="refuse model paths outside this directory (env NETRA_JAX_ALLOWED_MODEL_ROOT)",
    )
    p.add_argument(
        "--warmup",
        choices=("early", "full"),
        default="early",
        help="early (default): ready once the programs the first requests need are compiled, the rest compiling in "
        "the background (steps pad up into compiled buckets meanwhile; /metrics netra_programs_pending counts them); "
        "full: ready once every program is compiled (benchmarks)",
    )
    p.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/engine (step count, KV blocks, pool invariant, compilations)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (with --enable-lora): name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request selects one by its "model"',
    )
    p.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM gates them behind the environment "
        "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING; here a flag, off by default: they read paths on the server)",
    )
    add_chat_output_args(p)


def add_chat_output_args(p: argparse.ArgumentParser) -> None:
    """How chat requests are rendered and their answers read, with vLLM's flags (serve and batch)."""
    from netra_jax.serving.reasoning import REASONING_PARSERS
    from netra_jax.serving.tool_parsers import TOOL_PARSERS

    p.add_argument(
        "--chat-template",
        default=None,
        help="chat template (a file path or the Jinja source) replacing the checkpoint's",
    )

    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default when tools are sent): the --tool-call-parser reads calls from the text',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes), llama3_json, mistral",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="put <think>...</think> into reasoning_content: qwen3, deepseek_r1",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='with tool_choice "none" the chat template is not shown the tools (by default it is, as in vLLM)',
    )


def chat_output_config(args: argparse.Namespace):
    """The ChatOutputConfig of the flags above; ValueError for a combination vLLM refuses too."""
    from netra_jax.serving.chat_output import ChatOutputConfig

    return ChatOutputConfig(
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )


def check_model_root(model: str | None, root: str | None) -> None:
    """ValueError if `model` has a `..` component or resolves (symlinks included) outside `root`. No-op without a
    root, or without a model argument (the embedded default model is always allowed)."""
    if not root or not model:
        return
    if ".." in Path(model).parts:
        raise ValueError(f"model path {model!r} contains '..'")
    base = Path(root).resolve()
    target = Path(model).resolve()
    if not target.is_relative_to(base):
        raise ValueError(f"model path {model!r} is outside the allowed model root {str(base)!r}")


def load_chat_template(value: str | None) -> str | None:
    """A file's contents, or `value` itself when it looks like a Jinja template."""
    if value is None:
        return None
    p = Path(value)
    if len(value) < 4096 and p.is_file():
        return p.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _run_uvicorn(app, args: argparse.Namespace, on_drain, on_started, holder: dict | None = None) -> int:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT: stop accepting, mark the app as draining, let in-flight requests end (up to the
        graceful timeout), then return normally (uvicorn would re-raise the signal and die with it)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            prev = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in prev.items():
                    signal.signal(s, h)

        def _on_signal(self, sig, frame) -> None:
            on_drain()
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                sock = self.servers[0].sockets[0].getsockname()
                on_started(sock[0], sock[1])

    level = args.log_level.lower() if isinstance(getattr(args, "log_level", None), str) else "warning"
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=level,
        access_log=level == "debug",
        timeout_graceful_shutdown=max(0.0, args.drain_timeout),
        lifespan="off",
    )
    server = DrainingServer(config)
    if holder is not None:
        holder["server"] = server
    try:
        server.run()
    except SystemExit as e:  # uvicorn exits 1 when it cannot bind
        return int(e.code or 0)
    return 0 if server.started else 1


def serve(args: argparse.Namespace) -> int:
    from netra_jax.engine.async_engine import AsyncEngine
    from netra_jax.engine.factory import resolve_model_path
    from netra_jax.engine_args import CLIError, engine_config, load_engine, one_line
    from netra_jax.serving.context import served_model_name
    from netra_jax.serving.lora_modules import ServedAdapters, parse_lora_modules
    from netra_jax.tokenization.chat_template import NoChatTemplateError

    try:
        check_model_root(args.model, args.allowed_model_root)
        template = load_chat_template(args.chat_template)
        chat_output = chat_output_config(args)
        lora_modules = parse_lora_modules(args.lora_modules)
        if (lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        for m in lora_modules:
            check_model_root(m.path, args.allowed_model_root)
    except (OSError, ValueError) as e:
        print(f"netra-jax serve: {e}", file=sys.stderr)
        return 2
    cfg = engine_config(args)
    t0 = time.perf_counter()
    try:
        engine = load_engine(dataclasses.replace(cfg, warmup=False))
    except CLIError as e:  # missing, refused (pickles, remote code), unsupported or damaged checkpoints
        print(f"netra-jax serve: {e}", file=sys.stderr)
        return 2
    mc = engine.model_config
    name = served_model_name(args.model, args.served_model_name)
    loaded = engine.compiled_report
    if loaded is not None and not loaded.mismatch:  # a mismatch was logged as a warning by the engine's factory
        secs = f"{loaded.seconds:.1f}s"
        print(f"netra-jax: loaded {loaded.loaded} compiled programs from {cfg.compiled} in {secs}", flush=True)
    if template is not None:
        try:
            engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template)
        except ValueError as e:
            print(f"netra-jax serve: the chat template does not render: {e}", file=sys.stderr)
            return 2
    elif engine.pooling is None and not engine.tokenizer.special.chat_templates:  # embedding servers do not chat
        hint = "they get 400 (start the server with --chat-template to give it one)"
        print(f"netra-jax: {NoChatTemplateError.message(hint)}", flush=True)
    dtype = str(next(iter(_leaves(engine.runner.params))).dtype)
    print(
        f"netra-jax: loaded {resolve_model_path(cfg.model)} as {name!r} ({mc.architecture}, {mc.num_layers} layers, "
        f"vocab {mc.vocab_size}, {dtype}) in {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    if engine.pooling is not None:  # --task embed: no KV cache to speak of, embedding steps bring their own pages
        pooling = engine.pooling
        print(
            f"netra-jax: embeddings: {pooling.pooling_type} pooling{', normalized' if pooling.normalize else ''} "
            f"(from {pooling.source}); up to {engine.embedder.max_tokens} tokens per step; max_model_len "
            f"{engine.max_model_len}",
            flush=True,
        )
    else:
        print(
            f"netra-jax: KV cache {engine.kv_capacity_tokens} tokens ({engine.pool.num_total} pages of "
            f"{engine.pool.block_size}, {engine.kv_cache_dtype}); max_model_len {engine.max_model_len}",
            flush=True,
        )
    adapters = ServedAdapters()
    for m in lora_modules:  # read and checked now: a bad adapter stops the server before it listens
        try:
            adapters.load(engine, m)
        except ValueError as e:
            print(f"netra-jax serve: --lora-modules {m.name}: {one_line(e)}", file=sys.stderr)
            return 2
        print(f"netra-jax: LoRA adapter {m.name!r} from {m.path}", flush=True)
    # warm-up starts now: the server's own imports and set-up below overlap its first compiles
    warm = threading.Event()
    bound: dict[str, tuple[str, int]] = {}
    lock = threading.Lock()

    def announce() -> None:
        with lock:
            if warm.is_set() and "addr" in bound and not bound.get("said"):
                bound["said"] = ("", 0)
                host, port = bound["addr"]
                print(f"netra-jax: ready on http://{host}:{port} (OpenAI API at http://{host}:{port}/v1)", flush=True)

    def on_started(host: str, port: int) -> None:
        bound["addr"] = (host, port)
        if not warm.is_set():
            print(f"netra-jax: listening on http://{host}:{port} (/health 200; /ready 503 until warm)", flush=True)
        announce()

    def warm_up() -> None:
        if cfg.warmup:
            print("netra-jax: warming up (/health answers 200, /ready 503 until done) ...", flush=True)
            say = lambda line: print(f"netra-jax: {line}", flush=True)  # noqa: E731
            try:
                secs = engine.warmup(progress=say, background=args.warmup == "early")
            except Exception as e:  # a server that cannot compile its programs cannot serve: say why and exit
                print(f"netra-jax: warm-up failed: {one_line(e)}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(1)
            report = engine.warmup_report
            rest = f"; {report.pending} more compiling in the background" if report.pending else ""
            say(f"warm-up done in {secs:.1f}s ({len(report.compiled)} variants compiled{rest})")
        warm.set()
        announce()

    threading.Thread(target=warm_up, name="netra-warmup", daemon=True).start()
    ae = AsyncEngine(engine, step_timeout=args.step_timeout)
    from netra_jax.serving.app import create_app

    origins = [o.strip() for o in args.cors_origins.split(",") if o.strip()] if args.cors_origins else None
    app = create_app(
        ae,
        name,
        args.api_key,
        chat_template=template,
        max_body_bytes=args.max_body_bytes,
        cors_origins=origins,
        ready=warm.is_set,
        chat_output=chat_output,
        adapters=adapters,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )
    if args.enable_debug_endpoints:
        from netra_jax.serving.debug import install_debug_routes

        install_debug_routes(app)
    state = app.state.server

    def on_drain() -> None:
        if not state.draining:
            state.draining = True
            print(f"netra-jax: draining ({ae.num_unfinished} in flight, up to {args.drain_timeout:g}s)", flush=True)

    holder: dict = {}
    died = threading.Event()
    stop_watch = threading.Event()

    def watch_engine() -> None:
        """Engine dead (a step raised, or hung past --step-timeout): answer 503 for a moment, then exit non-zero."""
        while not stop_watch.wait(0.1):
            if ae.is_alive or stop_watch.is_set():
                continue
            died.set()
            why = repr(ae.dead) if ae.dead is not None else "a step exceeded --step-timeout"
            print(
                f"netra-jax: engine failed ({why}); exiting with status {ENGINE_DEAD_EXIT} in {DEAD_GRACE_S:g}s",
                flush=True,
            )
            time.sleep(DEAD_GRACE_S)
            while holder.get("server") is None and not stop_watch.wait(0.1):
                pass
            if holder.get("server") is not None:
                holder["server"].should_exit = True
            return

    threading.Thread(target=watch_engine, name="netra-engine-watch", daemon=True).start()
    code = 0
    try:
        code = _run_uvicorn(app, args, on_drain, on_started, holder)
    finally:
        stop_watch.set()
        engine.stop_background_compile(timeout=2.0 if died.is_set() else 60.0)  # no compile runs on into the exit
        ae.shutdown(timeout=2.0 if died.is_set() else 5.0)
        print("netra-jax: stopped", flush=True)
    if died.is_set():
        code = ENGINE_DEAD_EXIT
        if ae.loop_running:  # a step is stuck in native code: do not wait for it at interpreter exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return code


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)
