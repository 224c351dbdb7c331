"""Tokenizer: text <-> token ids for Hugging Face model directories and GGUF files, plus chat prompts.
Wraps a `tokenizers.Tokenizer` (rebuilt from GGUF metadata when needed) with special-token and template info."""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from netra_jax.loader.gguf_loader import read_gguf_metadata
from netra_jax.tokenization.chat_template import (
    ChatTemplateError,
    ChatTemplateLimits,
    NoChatTemplateError,
    render_chat_template,
)
from netra_jax.tokenization.gguf import tokenizer_from_gguf_metadata


@dataclass(frozen=True)
class SpecialTokens:
    """Special tokens as strings (for chat templates) and ids (for generation)."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    chat_templates: Mapping[str, str] = field(default_factory=dict)  # name -> template; "default" first


# ---------------------------------------------------------------------------------------- Hugging Face directory


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with `content`."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where} must be an int or a list of ints, got {value!r}")
    return values


def _hf_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates by name; a chat_template.jinja file overrides tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    for raw in (config.get("chat_template"), _read_json(path / "chat_template.json").get("chat_template")):
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for entry in raw:
                if not isinstance(entry, Mapping) or not isinstance(entry.get("template"), str):
                    raise ValueError(f"{path}: a named chat template must be {{'name': str, 'template': str}}")
                templates[str(entry.get("name", "default"))] = entry["template"]
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    for extra in sorted((path / "additional_chat_templates").glob("*.jinja")):
        templates.setdefault(extra.stem, extra.read_text(encoding="utf-8"))
    return templates


def _hf_special_tokens(path: Path, backend: tokenizers.Tokenizer) -> SpecialTokens:
    config = _read_json(path / "tokenizer_config.json")
    gen, model = _read_json(path / "generation_config.json"), _read_json(path / "config.json")
    texts = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def id_of(key: str) -> int | None:
        text = texts[key]
        return None if text is None else backend.token_to_id(text)

    def first(*values: Any) -> int | None:
        return next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), None)

    eos_ids = [
        *_id_list(gen.get("eos_token_id"), "generation_config.json eos_token_id"),
        *([id_of("eos_token")] if id_of("eos_token") is not None else []),
        *_id_list(model.get("eos_token_id"), "config.json eos_token_id"),
    ]
    return SpecialTokens(
        **texts,
        bos_token_id=first(id_of("bos_token"), gen.get("bos_token_id"), model.get("bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        pad_token_id=first(id_of("pad_token"), gen.get("pad_token_id"), model.get("pad_token_id")),
        chat_templates=_hf_chat_templates(path, config),
    )


# --------------------------------------------------------------------------------------------------- Tokenizer


class Tokenizer:
    """Encode, decode and build chat prompts for one model; thread-safe for concurrent use."""

    def __init__(
        self, backend: tokenizers.Tokenizer, special: SpecialTokens, template_limits: ChatTemplateLimits | None = None
    ) -> None:
        self.backend = backend
        self.special = special
        self.template_limits = template_limits or ChatTemplateLimits()
        added = backend.get_added_tokens_decoder()
        self._vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
        for name, i in [("bos", special.bos_token_id), ("pad", special.pad_token_id)] + [
            ("eos", i) for i in special.eos_token_ids
        ]:
            if i is not None and not 0 <= i < self._vocab_size:
                raise ValueError(f"{name} token id {i} is outside the vocabulary (size {self._vocab_size})")
        ids = {i for i, t in added.items() if t.special} | set(special.eos_token_ids)
        ids |= {i for i in (special.bos_token_id, special.pad_token_id) if i is not None}
        self._all_special_ids = tuple(sorted(ids))
        tokens = {"bos_token": special.bos_token, "eos_token": special.eos_token}
        tokens |= {"pad_token": special.pad_token, "unk_token": special.unk_token}
        self._template_tokens = {k: v for k, v in tokens.items() if v is not None}

    # -- construction

    @classmethod
    def from_hf_dir(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        """A Hugging Face model directory: tokenizer.json, tokenizer_config.json, generation_config.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (SentencePiece-only tokenizer.model is unsupported)")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        return cls(backend, _hf_special_tokens(path, backend), **kwargs)

    @classmethod
    def from_gguf(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) or
        SentencePiece (`"llama"`)."""
        backend, special = tokenizer_from_gguf_metadata(read_gguf_metadata(path), str(path))
        return cls(backend, SpecialTokens(**special), **kwargs)

    @classmethod
    def load(cls, path: str | Path, **kwargs: Any) -> Tokenizer:
        """A model directory, its tokenizer.json, or a .gguf file."""
        path = Path(path)
        if path.is_dir():
            return cls.from_hf_dir(path, **kwargs)
        if path.is_file() and path.name == "tokenizer.json":
            return cls.from_hf_dir(path.parent, **kwargs)
        if path.is_file() and path.suffix.lower() == ".gguf":
            return cls.from_gguf(path, **kwargs)
        raise FileNotFoundError(f"{path} is neither a model directory, a tokenizer.json nor a .gguf file")

    # -- vocabulary

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.special.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.special.bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.special.pad_token_id

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return self._all_special_ids

    @property
    def chat_template(self) -> str | None:
        return self.special.chat_templates.get("default")

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        (i,) = self.check_ids([token_id])
        token = self.backend.id_to_token(i)
        if token is None:
            raise ValueError(f"token id {i} has no token")
        return token

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.id_to_token(i) for i in self.check_ids(ids)]

    def check_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` as a list of Python ints; TypeError for non-integers, ValueError for ids outside the vocabulary."""
        if hasattr(ids, "tolist"):  # numpy / jax arrays
            ids = ids.tolist()
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"token ids must be a sequence of ints, got {type(ids).__name__}")
        try:
            out = [operator.index(i) for i in ids]
        except TypeError:
            raise TypeError("token ids must be ints") from None
        bad = [i for i in out if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self._vocab_size}): {bad[:8]}")
        return out

    # -- text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. `<|im_start|>`) map to their ids."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a list of str")
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(self.check_ids(ids), skip_special_tokens=skip_special_tokens)

    # -- chat

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        named = self.special.chat_templates
        if chat_template is not None:
            return named.get(chat_template, chat_template)  # a template name, or the template itself
        if tools and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        if named:
            raise ChatTemplateError(f"no default chat template; choose one of {sorted(named)} with chat_template=")
        raise NoChatTemplateError("pass chat_template= (a Jinja template) or send plain prompts")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for a conversation, as transformers renders it (`tokenize=False`).

        `chat_template` is a template name (from a list of named templates) or the Jinja source itself.
        Extra keyword arguments (`continue_final_message`, `documents`, `enable_thinking`...) reach the template.
        """
        template = self._select_template(chat_template, tools)
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self._template_tokens,
            limits=self.template_limits,
            **kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of the chat prompt. The template places any BOS itself, so none is added (as transformers)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False)
