"""Embedding models on the host side: the pooling a checkpoint asks for (its sentence-transformers modules, else
vLLM's default), vLLM's PoolingParams and embedding outputs, prompt checks, and Matryoshka truncation + L2 norm.

The device side (pooled final hidden states of a batch of prompts) is `netra_jax.engine.embedder`. vLLM's rules
followed here: an explicit `PoolerConfig` field wins over modules.json, which wins over the embed default (LAST
token, normalized); `dimensions` needs a Matryoshka model (config.json `is_matryoshka` or `matryoshka_dimensions`)
and keeps the first `dimensions` values, normalized afterwards; `truncate_prompt_tokens` keeps the last k tokens."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from netra_jax.config import ConfigError, json_object
from netra_jax.engine_config import PoolerConfig

__all__ = [
    "NOT_AN_EMBEDDING_ENGINE",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingError",
    "PoolingParams",
    "PoolingSpec",
    "embedding_prompt_ids",
    "finish_embeddings",
    "pooler_config_from",
    "pooling_spec",
    "sentence_transformers_pooler",
]

DEFAULT_POOLER = PoolerConfig(pooling_type="LAST", normalize=True)  # vLLM's default for task "embed"
# sentence-transformers pooling modes (a `pooling_mode_<mode>: true` flag, or `pooling_mode: "<mode>"`)
_ST_MODES = {"lasttoken": "LAST", "mean_tokens": "MEAN", "mean": "MEAN", "cls_token": "CLS", "cls": "CLS"}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


NOT_AN_EMBEDDING_ENGINE = "embeddings need a model loaded with task 'embed'; this one generates text"


class PoolingError(ValueError):
    """A bad embedding request (input, dimensions, truncation); `param` names the offending API field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class PoolingSpec:
    """The pooling one served embedding model does, resolved once at load: type (LAST | MEAN | CLS), whether it
    normalizes, its hidden size and its Matryoshka capability (None: any dimensions, when `matryoshka`)."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"  # where the pooling came from: "pooler_config", "modules.json" or "default"


@dataclass
class PoolingParams:
    """vLLM's PoolingParams for embeddings. dimensions: keep the first n values (Matryoshka models only);
    use_activation (vLLM's name) or normalize (its older name): L2-normalize, None = the model's default;
    truncate_prompt_tokens: keep the last k tokens (-1: the model's context), None = refuse longer prompts."""

    dimensions: int | None = None
    use_activation: bool | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None

    def resolved_normalize(self, spec: PoolingSpec) -> bool:
        if self.use_activation is not None and self.normalize is not None and self.use_activation != self.normalize:
            raise PoolingError("use_activation and normalize disagree; give one of them", "normalize")
        chosen = self.use_activation if self.use_activation is not None else self.normalize
        return spec.normalize if chosen is None else chosen

    def verify(self, spec: PoolingSpec, model_name: str) -> None:
        """vLLM's checks of `dimensions`, plus: not more than the hidden size. Raises PoolingError."""
        self.resolved_normalize(spec)
        d = self.dimensions
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, int):
            raise PoolingError(f"dimensions must be an integer, got {d!r}", "dimensions")
        if not spec.matryoshka:
            raise PoolingError(
                f'Model "{model_name}" does not support matryoshka representation, changing output dimensions will '
                "lead to poor results.",
                "dimensions",
            )
        if spec.matryoshka_dimensions is not None and d not in spec.matryoshka_dimensions:
            raise PoolingError(
                f'Model "{model_name}" only supports {list(spec.matryoshka_dimensions)} matryoshka dimensions, use '
                "other output dimensions will lead to poor results.",
                "dimensions",
            )
        if d < 1:
            raise PoolingError("Dimensions must be greater than 0", "dimensions")
        if d > spec.hidden_size:
            raise PoolingError(
                f"dimensions ({d}) is larger than the model's embedding size {spec.hidden_size}", "dimensions"
            )


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: one embedding vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput: `outputs.embedding` of one prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


# ---------------------------------------------------------------------------------------------- model's pooling
def sentence_transformers_pooler(model_dir: str | Path) -> PoolerConfig | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json -> the Pooling module's config.json,
    and whether a Normalize module follows), as vLLM reads it; None when there is no modules.json or no Pooling
    module. A pooling mode vLLM cannot run (max, weighted mean, ...) is a ConfigError."""
    path = Path(model_dir)
    modules_file = path / "modules.json"
    if not path.is_dir() or not modules_file.is_file():
        return None
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{modules_file}: expected a list of module objects")
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return None
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    config_file = path / str(pooling.get("path", "")) / "config.json"
    config = _json(config_file) if config_file.is_file() else {}
    modes = [k.removeprefix("pooling_mode_") for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if isinstance(config.get("pooling_mode"), str):  # sentence-transformers 6 writes the mode's name
        modes.append(config["pooling_mode"])
    if not modes:
        return PoolerConfig(normalize=normalize)
    unknown = [m for m in modes if m not in _ST_MODES]
    if unknown or len({_ST_MODES[m] for m in modes}) > 1:
        raise ConfigError(
            f"{config_file}: pooling mode {' + '.join(modes)} is not supported (last token, mean or CLS only)"
        )
    return PoolerConfig(pooling_type=_ST_MODES[modes[0]], normalize=normalize)


def pooler_config_from(value: PoolerConfig | dict[str, Any] | str | None) -> PoolerConfig | None:
    """A PoolerConfig from vLLM's --pooler-config forms: the object, a dict or its JSON text, with keys
    pooling_type (or seq_pooling_type) LAST | MEAN | CLS and normalize (or use_activation). ConfigError if bad."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    value = json_object(value, "pooler config")
    names = {"pooling_type": "pooling_type", "seq_pooling_type": "pooling_type"}
    names |= {"normalize": "normalize", "use_activation": "normalize"}
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigError(f"pooler config: unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
    fields = {names[k]: v for k, v in value.items()}
    if isinstance(fields.get("pooling_type"), str):
        fields["pooling_type"] = fields["pooling_type"].upper()
    if fields.get("normalize") is not None and not isinstance(fields["normalize"], bool):
        raise ConfigError(f"pooler config: normalize must be true or false, got {fields['normalize']!r}")
    return PoolerConfig(**fields)


def pooling_spec(model_path: str | Path | None, hidden_size: int, override: PoolerConfig | None = None) -> PoolingSpec:
    """The PoolingSpec of a checkpoint: `override`'s fields, then its sentence-transformers modules', then vLLM's
    default (LAST, normalized); Matryoshka capability from config.json as vLLM reads it. model_path None: no
    checkpoint files to read (the override and the default only)."""
    model_path = Path(model_path) if model_path is not None else None
    found = sentence_transformers_pooler(model_path) if model_path is not None else None
    layers = [(override, "pooler_config"), (found, "modules.json"), (DEFAULT_POOLER, "default")]
    pooling_type, ptype_from = next((c.pooling_type, src) for c, src in layers if c and c.pooling_type is not None)
    normalize = next(c.normalize for c, _ in layers if c and c.normalize is not None)
    config_file = model_path / "config.json" if model_path is not None else None
    hf = _json(config_file) if config_file is not None and config_file.is_file() else {}
    dims = hf.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not all(isinstance(d, int) for d in dims)):
        raise ConfigError(f"{config_file}: matryoshka_dimensions must be a list of integers, got {dims!r}")
    return PoolingSpec(
        pooling_type=pooling_type,
        normalize=bool(normalize),
        hidden_size=hidden_size,
        matryoshka=bool(dims) or bool(hf.get("is_matryoshka", False)),
        matryoshka_dimensions=tuple(dims) if dims else None,
        source=ptype_from,
    )


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot read JSON: {e}") from e


# ---------------------------------------------------------------------------------------------- requests
def embedding_prompt_ids(ids: Sequence[int], max_model_len: int, truncate_prompt_tokens: int | None) -> list[int]:
    """A prompt's token ids as embedded: truncated to the last k tokens when asked (k = -1: the model's context),
    refused (PoolingError) when longer than the context otherwise, or when empty. Ids are checked by the caller."""
    k = truncate_prompt_tokens
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
            raise PoolingError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}", "input")
        if k > max_model_len:
            raise PoolingError(
                f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({max_model_len}). Please, select "
                "a smaller truncation size.",
                "truncate_prompt_tokens",
            )
        ids = ids[-(max_model_len if k == -1 else k) :]
    if not ids:
        raise PoolingError("input is empty", "input")
    if len(ids) > max_model_len:
        raise PoolingError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {len(ids)} tokens "
            "in the input for embedding generation. Please reduce the length of the input (or set "
            "truncate_prompt_tokens).",
            "input",
        )
    return list(ids)


def finish_embeddings(pooled: np.ndarray, params: PoolingParams, spec: PoolingSpec) -> np.ndarray:
    """The returned embeddings of pooled hidden states [n, hidden] float32: the first `dimensions` values, then
    L2-normalized when the request (or the model's default) says so, as vLLM's embedding head does. [n, dims]"""
    out = np.asarray(pooled, np.float32)
    if params.dimensions is not None:
        out = out[:, : params.dimensions]
    if params.resolved_normalize(spec):
        norm = np.linalg.norm(out, axis=-1, keepdims=True)  # [n, 1]
        out = out / np.maximum(norm, 1e-12)  # torch.nn.functional.normalize's eps
    return out
