"""`netra-jax` command line: serve (OpenAI-compatible HTTP), chat / generate (one-off prompts), batch (OpenAI Batch
JSONL), compile (every program of one configuration, for a target machine) and bench. Engine flags follow vLLM's
names; with no MODEL the embedded default model is used. A model that cannot be loaded, or a chat without a chat
template, is reported in one line with exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from netra_jax.engine_args import CLIError, add_engine_args, engine_config, load_engine, one_line
from netra_jax.targets import TARGETS

log = logging.getLogger(__name__)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def _one_off(a: argparse.Namespace, chat: bool) -> int:
    from netra_jax.sampling_params import SamplingParams
    from netra_jax.serving.cli import load_chat_template
    from netra_jax.tokenization.chat_template import NoChatTemplateError

    template = None
    if chat:
        try:
            template = load_chat_template(a.chat_template)
        except (OSError, ValueError) as e:
            raise CLIError(one_line(e)) from None
    engine = load_engine(dataclasses.replace(engine_config(a), warmup=False))  # compile only what is used
    tok = engine.tokenizer
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    if chat:
        messages = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}
        ]
        try:
            prompt = {"prompt_token_ids": tok.encode_chat(messages, chat_template=template)}
        except NoChatTemplateError:
            hint = (
                "give one with --chat-template (a file or the Jinja source), or complete a raw prompt with "
                "`netra-jax generate`"
            )
            raise CLIError(NoChatTemplateError.message(hint)) from None
        except ValueError as e:
            raise CLIError(f"the chat template does not render: {one_line(e)}") from None
    else:
        prompt = a.prompt
    engine.add_request("cli", prompt, sp)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _compile(a: argparse.Namespace) -> int:
    """`netra-jax compile`: the engine's programs for `--target`, written to `--output` (engine/aot.py)."""
    import time

    import jax

    from netra_jax.engine.aot import compile_bundle
    from netra_jax.engine.factory import resolve_model_path

    # jax reads $JAX_COMPILATION_CACHE_DIR into its config at import; nothing is compiled yet, so drop it here (the
    # bundle's executables must not come from that cache: compile_bundle refuses while one is configured)
    jax.config.update("jax_compilation_cache_dir", None)
    config = engine_config(a)
    t0 = time.perf_counter()
    try:
        manifest = compile_bundle(
            config, a.target, a.output, workers=a.workers, progress=lambda line: print(f"netra-jax: {line}", flush=True)
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise CLIError(f"cannot compile {resolve_model_path(config.model)} for {a.target}: {one_line(e)}") from e
    size = sum(p["bytes"] for p in manifest["programs"])
    print(
        f"netra-jax: {len(manifest['programs'])} programs for {a.target} in {time.perf_counter() - t0:.1f}s "
        f"({size / 2**20:.1f} MiB) written to {a.output}; serve them with --compiled {a.output}",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netra-jax", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("chat", "answer one chat message"), ("generate", "complete one raw prompt")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("prompt")
        add_engine_args(p)
        _sampling_args(p)
        if name == "chat":
            p.add_argument("--system", default=None, help="system message (default: the template's own)")
            p.add_argument(
                "--chat-template", default=None, help="chat template (a file path or the Jinja source) to use"
            )
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    try:
        from netra_jax.serving.cli import add_serve_args

        add_serve_args(p)
    except ImportError:
        pass
    p = sub.add_parser(
        "compile",
        help="compile every program of one engine configuration for a target machine (no GPU needed for a GPU "
        "target), into a directory that --compiled loads",
    )
    add_engine_args(p)
    p.add_argument(
        "--target",
        default="cpu",
        choices=TARGETS,
        help="the machine the programs run on: cpu (this host) or a GPU (h100, h200, a100; compiled here without one)",
    )
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the directory to write the programs to")
    p.add_argument("--workers", type=int, default=None, help="compiling threads (default: this process's CPUs)")
    p = sub.add_parser("batch", help="run an OpenAI Batch JSONL file offline (resumable)")
    from netra_jax.serving.batch_cli import add_batch_args

    add_batch_args(p)
    p = sub.add_parser("bench", help="benchmarks (serve: load-test an OpenAI-compatible server)")
    bench = p.add_subparsers(dest="bench_cmd", required=True)
    bench.add_parser("serve", add_help=False, help="serving benchmark; `netra-jax bench serve --help` for its flags")
    a, rest = parser.parse_known_args(argv)
    if a.cmd == "bench":  # the benchmark parses its own flags
        logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from netra_jax.bench.serve import main as bench_serve_main

        return bench_serve_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if a.cmd in ("chat", "generate"):
            return _one_off(a, a.cmd == "chat")
        if a.cmd == "serve":
            from netra_jax.serving.cli import serve

            return serve(a)
        if a.cmd == "compile":
            return _compile(a)
        if a.cmd == "batch":
            from netra_jax.serving.batch_cli import main as batch_main

            return batch_main(a)
    except CLIError as e:
        print(f"netra-jax {a.cmd}: {e}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {a.cmd}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
