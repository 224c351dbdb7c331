"""The `netra-jax batch` command: its flags (the engine's, the chat output's, Ray's) and the job run by one local
engine (`serving.batch`) or scaled out over Ray Data (`serving.batch_ray`), a model that cannot load reported in one
line before any worker starts."""

from __future__ import annotations

import argparse
import sys

from netra_jax.serving.batch import run_batch

__all__ = ["add_batch_args", "main"]


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """`netra-jax batch INPUT OUTPUT [--model MODEL] [engine flags] [--ray --replicas N]`."""
    from netra_jax.engine_args import add_engine_args
    from netra_jax.serving.cli import add_chat_output_args

    p.add_argument("input", help="OpenAI Batch JSONL input file")
    p.add_argument("output", help="JSONL output file (appended to; custom_ids already there are skipped)")

    class _ModelAsFlag:  # add_engine_args' positional MODEL becomes --model here
        def add_argument(self, *args, **kw):
            if args == ("model",):
                return p.add_argument("--model", default=None, help=kw.get("help"))
            return p.add_argument(*args, **kw)

    add_engine_args(_ModelAsFlag())
    add_chat_output_args(p)
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters a request body's model may name (with --enable-lora), as serve's",
    )
    p.add_argument("--max-in-flight", type=int, default=None, help="sequences queued per engine (4 * max-num-seqs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or summary on stderr")
    p.add_argument("--ray", action="store_true", help="scale out with Ray Data (needs netra-jax[ray])")
    p.add_argument("--replicas", type=int, default=1, help="engine actors with --ray")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local or $RAY_ADDRESS)")
    p.add_argument("--ray-batch-size", type=int, default=None, help="requests per Ray batch (8 * max-num-seqs)")


def main(a: argparse.Namespace) -> int:
    from netra_jax.engine_args import check_model, engine_config, load_engine
    from netra_jax.serving.cli import chat_output_config, load_chat_template
    from netra_jax.serving.lora_modules import parse_lora_modules

    cfg = engine_config(a)
    try:
        chat_output = chat_output_config(a)
        chat_template = load_chat_template(a.chat_template)
        lora_modules = parse_lora_modules(a.lora_modules)
        if lora_modules and not a.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
    except (OSError, ValueError) as e:
        print(f"netra-jax batch: {e}", file=sys.stderr)
        return 2
    if a.ray:
        try:
            from netra_jax.serving.batch_ray import run_batch_ray
        except ImportError as e:
            print(f"netra-jax batch --ray needs Ray Data: pip install 'netra-jax[ray]' ({e})", file=sys.stderr)
            return 2

        check_model(cfg)  # the workers load it: a model that cannot load is reported here, in one line
        run_batch_ray(
            a.input,
            a.output,
            cfg,
            replicas=a.replicas,
            batch_size=a.ray_batch_size,
            address=a.ray_address,
            max_in_flight=a.max_in_flight,
            progress=not a.no_progress,
            chat_output=chat_output,
            chat_template=chat_template,
            lora_modules=lora_modules,
        )
        return 0
    engine = load_engine(cfg)
    run_batch(
        a.input,
        a.output,
        engine,
        max_in_flight=a.max_in_flight,
        progress=not a.no_progress,
        chat_output=chat_output,
        chat_template=chat_template,
        lora_modules=lora_modules,
    )
    return 0
