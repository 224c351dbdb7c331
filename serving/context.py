"""What every OpenAI request is prepared and answered against: the engine, the served model's one name, its chat
template, per-token text. The server and batch jobs build one each, so both answer a body the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from netra_jax.serving.chat_output import ChatOutputConfig
from netra_jax.serving.lora_modules import ServedAdapters
from netra_jax.serving.render import TokenText

if TYPE_CHECKING:
    from netra_jax.engine.engine import LLMEngine


def served_model_name(model: str | None, override: str | None = None) -> str:
    """The name a request's `model` must carry: `override` (--served-model-name), else the model path's name (a
    .gguf file's stem: `SmolLM2-135M-Instruct.Q4_1` for `.../SmolLM2-135M-Instruct.Q4_1.gguf`, a directory's name:
    `tiny-llama`), else the embedded default model's name, `SmolLM2-135M-Instruct`."""
    if override:
        return override
    if not model:
        from netra_jax.assets import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    p = Path(model)
    return p.stem if p.suffix.lower() == ".gguf" else p.name


@dataclass(frozen=True)
class ServingContext:
    """`chat_template`: Jinja source replacing the checkpoint's (requests cannot supply one). `chat_output`: how
    chat answers are read (tool-call and reasoning parsers). `adapters`: the LoRA adapters a request's `model` may
    name besides `model_name`."""

    llm: LLMEngine
    model_name: str
    tokens: TokenText
    chat_template: str | None = None
    chat_output: ChatOutputConfig = ChatOutputConfig()
    adapters: ServedAdapters = field(default_factory=ServedAdapters)

    @classmethod
    def of(
        cls,
        llm: LLMEngine,
        model_name: str,
        chat_template: str | None = None,
        chat_output: ChatOutputConfig | None = None,
        adapters: ServedAdapters | None = None,
    ) -> ServingContext:
        tokens = TokenText(llm.tokenizer)
        return cls(
            llm, model_name, tokens, chat_template, chat_output or ChatOutputConfig(), adapters or ServedAdapters()
        )
