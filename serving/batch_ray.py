"""Ray Data scale-out of batch jobs: the same OpenAI Batch JSONL in and out as serving.batch, with the requests
spread over N engine actors (one engine each, one GPU each on GPU clusters) by `map_batches`. Needs netra-jax[ray]."""

from __future__ import annotations

import json
import math
import os
import time
from typing import TYPE_CHECKING, Any

from netra_jax.serving.batch import BatchSummary, OutputWriter, close_job, open_job, process, served_model_name
from netra_jax.serving.batch_io import Work, classify, read_lines

if TYPE_CHECKING:
    from netra_jax.engine_config import EngineConfig
    from netra_jax.serving.chat_output import ChatOutputConfig


class EngineActor:
    """A Ray Data callable class: builds one engine, then turns each batch of Work lines into output lines."""

    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        max_in_flight: int | None = None,
        chat_output: ChatOutputConfig | None = None,
        chat_template: str | None = None,
        lora_modules: list | None = None,
    ):
        from netra_jax.engine.factory import build_engine

        self.engine = build_engine(config)
        self.model_name = model_name
        self.window = max_in_flight or 4 * config.scheduler.max_num_seqs
        self.chat_output = chat_output
        self.chat_template = chat_template
        self.lora_modules = lora_modules

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        out: list[dict] = []
        works = [Work.from_json(str(t)) for t in batch["work"]]
        process(
            self.engine,
            works,
            out.append,
            self.model_name,
            self.window,
            self.chat_output,
            self.chat_template,
            self.lora_modules,
        )
        return {"output": [json.dumps(o, ensure_ascii=False) for o in out]}


def run_batch_ray(
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    engine_config: EngineConfig,
    *,
    replicas: int = 1,
    batch_size: int | None = None,
    num_gpus: float | None = None,
    address: str | None = None,
    max_in_flight: int | None = None,
    model_name: str | None = None,
    progress: bool = True,
    chat_output: ChatOutputConfig | None = None,
    chat_template: str | None = None,
    lora_modules: list | None = None,
) -> BatchSummary:
    """Run a batch file on `replicas` engine actors. The driver parses the input (malformed and duplicate lines
    and ids already in the output are settled here, as in run_batch), hands the remaining requests to Ray Data, and
    appends each returned output line to `output_path` (order may differ from the input). `num_gpus` per actor
    defaults to 1 when the cluster has GPUs, else 0. Connects to `address` (or $RAY_ADDRESS, or starts a local
    cluster) unless Ray is already initialised."""
    import ray

    t0 = time.perf_counter()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
    if num_gpus is None:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    name = model_name or served_model_name(engine_config)
    batch_size = batch_size or 8 * engine_config.scheduler.max_num_seqs
    prog, summary, bar = open_job(input_path, output_path, progress)
    try:
        with open(output_path, "a", encoding="utf-8") as f:
            writer = OutputWriter(f, summary, bar)
            todo = []
            for n, raw in read_lines(input_path):
                item = classify(n, raw, prog)
                if isinstance(item, Work):
                    todo.append({"work": item.to_json()})
                elif item is not None:
                    writer.emit(item)
            if bar is not None:
                bar.update(prog.skipped)
            if todo:
                blocks = max(replicas, math.ceil(len(todo) / batch_size))
                ds = ray.data.from_items(todo, override_num_blocks=blocks).map_batches(
                    EngineActor,
                    fn_constructor_kwargs={
                        "config": engine_config,
                        "model_name": name,
                        "max_in_flight": max_in_flight,
                        "chat_output": chat_output,
                        "chat_template": chat_template,
                        "lora_modules": lora_modules,
                    },
                    concurrency=replicas,
                    num_gpus=num_gpus,
                    num_cpus=1 if num_gpus else 0.5,
                    batch_size=batch_size,
                )
                for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                    for line in batch["output"]:
                        writer.emit(json.loads(str(line)))
    finally:
        close_job(prog, summary, bar, t0, progress)
    return summary
