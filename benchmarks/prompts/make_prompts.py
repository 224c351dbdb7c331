"""Writes the speculative-decoding prompt sets from grounded_texts.py: grounded.jsonl (copy, edit, convert or summarize
a given text: answers that reuse the prompt) and chat.jsonl (free-form questions: answers that do not).

Usage: `.venv/bin/python -m benchmarks.prompts.make_prompts [--check]` (--check: fail if the committed files differ
from what this would write). Each line is a chat request for `netra-jax bench serve --dataset jsonl --endpoint chat`
and `python -m benchmarks.spec_decode`: {"id", "kind", "messages", "max_tokens", "input_tokens"}; the user message is
the instruction then the text, or for a fenced code block the code then the instruction. The system message is
SmolLM2-Instruct's default one, written out so that every server renders the same prompt (llama-server's built-in
chatml template adds no default system message). input_tokens and max_tokens are counted with the default model's
tokenizer: a copy task may write 1.25x its text plus 16 tokens (64 to 256), a summary 160, a chat answer 192.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from benchmarks.prompts.grounded_texts import CHAT, TASKS

HERE = Path(__file__).resolve().parent

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SUMMARY_TOKENS, CHAT_TOKENS = 160, 192
INPUT_RANGE = (150, 600)  # prompt tokens of a grounded request, chat template included


def copy_budget(text_tokens: int) -> int:
    """max_tokens of a copy task: room for the whole text back plus a little, within 64..256."""
    return min(256, max(64, math.ceil(1.25 * text_tokens) + 16))


def _request(tok, rid: str, kind: str, user: str, max_tokens: int) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    n = len(tok.encode(prompt, add_special_tokens=False))
    return {"id": rid, "kind": kind, "messages": messages, "max_tokens": max_tokens, "input_tokens": n}


def grounded(tok) -> list[dict]:
    out = []
    for name, kind, instruction, text in TASKS:
        if kind == "copy":
            budget = copy_budget(len(tok.encode(text, add_special_tokens=False)))
        else:
            budget = SUMMARY_TOKENS
        user = f"{text}\n\n{instruction}" if text.startswith("```") else f"{instruction}\n\n{text}"
        req = _request(tok, name, kind, user, budget)
        lo, hi = INPUT_RANGE
        if not lo <= req["input_tokens"] <= hi:
            raise SystemExit(f"{name}: {req['input_tokens']} prompt tokens, outside {lo}..{hi}")
        out.append(req)
    return out


def chat(tok) -> list[dict]:
    return [_request(tok, f"chat_{i:02d}", "chat", q, CHAT_TOKENS) for i, q in enumerate(CHAT)]


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare with the files on disk instead of writing them")
    p.add_argument("--out-dir", default=str(HERE))
    a = p.parse_args(argv)
    from netra_jax.assets import default_model_path
    from netra_jax.tokenization.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path(quiet=True))
    stale = []
    for name, rows in (("grounded.jsonl", grounded(tok)), ("chat.jsonl", chat(tok))):
        path = Path(a.out_dir) / name
        text = render(rows)
        if a.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
            continue
        path.write_text(text)
        ins = [r["input_tokens"] for r in rows]
        print(f"wrote {path}: {len(rows)} requests, {min(ins)}-{max(ins)} prompt tokens")
    if stale:
        print(f"out of date (rerun python -m benchmarks.prompts.make_prompts): {' '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
