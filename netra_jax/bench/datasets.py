"""Request sets for netra_jax.bench.serve: random token prompts (detokenized by the server when it can, else random
words), a long-context preset, shared-prefix multi-turn conversations and JSONL files of prompts or chat messages."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import httpx

DATASETS = ("random", "long", "shared-prefix", "jsonl")
LONG_PRESET = {"input_len": 4000, "output_len": 128}  # long context: thousands of prompt tokens, short answers
WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education river stone cloud garden bread"
).split()


@dataclass
class Item:
    """One unit of work: a single request, or a conversation whose turns run one after another (each user turn sent
    with the system prompt and every earlier turn, the assistant's actual replies included)."""

    turns: list[str]  # user messages (single-turn items: the prompt)
    max_tokens: int
    system: str | None = None
    messages: list[dict] | None = None  # a JSONL chat line, sent as it is
    prompt_lens: list[int | None] = field(default_factory=list)  # tokens of each turn's own text, when known


class TextMaker:
    """Prompt text of a given token length. With the server's /detokenize, random token ids become text (re-checked
    and trimmed through /tokenize); otherwise random words, sized through /tokenize when that exists."""

    def __init__(self, client: httpx.AsyncClient | None, base: str, model: str | None, headers: dict | None = None):
        self.client, self.base, self.model, self.headers = client, base, model, headers or {}
        self.vocab: int | None = None  # ids below this decode; None: no /detokenize
        self.tok_style: str | None = None  # "vllm" ({"prompt"}), "llama.cpp" ({"content"}) or None: no /tokenize
        self.skip_special = True
        self.sem = asyncio.Semaphore(16)

    async def probe(self, n_vocab: int | None = None) -> None:
        """Find /tokenize's request style and the id range /detokenize takes (`n_vocab` when the server gave it)."""
        if self.client is None:
            return
        for style, body in (("vllm", {"prompt": "hello world"}), ("llama.cpp", {"content": "hello world"})):
            out = await self._post("/tokenize", body)
            if out is not None and out.get("tokens"):
                self.tok_style = style
                break
        if await self._detok([0]) is None:
            return
        if n_vocab:
            self.vocab = n_vocab
            return
        lo, hi = 1, 2  # ids < lo decode; find the first that does not
        while hi <= 1 << 22 and await self._detok([hi - 1]) is not None:
            lo, hi = hi, hi * 2
        if hi > 1 << 22:
            return
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if await self._detok([mid - 1]) is not None else (lo, mid)
        self.vocab = lo

    async def _post(self, path: str, body: dict) -> dict | None:
        if self.model:
            body = {"model": self.model, **body}
        try:
            async with self.sem:
                r = await self.client.post(self.base + path, json=body, headers=self.headers)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    async def _detok(self, ids: list[int]) -> str | None:
        body = {"tokens": ids, "skip_special_tokens": True} if self.skip_special else {"tokens": ids}
        out = await self._post("/detokenize", body)
        if out is None and self.skip_special:  # servers that refuse the extra field
            self.skip_special = False
            out = await self._post("/detokenize", {"tokens": ids})
            self.skip_special = out is None
        return None if out is None else out.get("prompt", out.get("content", ""))

    async def _tok(self, text: str) -> list[int] | None:
        if self.tok_style is None:
            return None
        body = {"prompt": text, "add_special_tokens": False} if self.tok_style == "vllm" else {"content": text}
        out = await self._post("/tokenize", body)
        return None if out is None else out.get("tokens")

    async def text(self, n: int, rng: random.Random) -> tuple[str, int | None]:
        """(text, its token count when the server could count it) for about n tokens."""
        if n <= 0:
            return "", 0
        if self.vocab is None:
            return await self._words(n, rng)
        ids = [rng.randrange(self.vocab) for _ in range(n)]
        count = None
        for _ in range(4):  # decode -> encode is not the identity: trim or extend the re-encoded ids
            text = await self._detok(ids)
            got = await self._tok(text)
            if got is None:
                return text, None
            count = len(got)
            if count == n:
                return text, n
            ids = got[:n] if count > n else got + [rng.randrange(self.vocab) for _ in range(n - count)]
        return text, count

    async def _words(self, n: int, rng: random.Random) -> tuple[str, int | None]:
        words = [rng.choice(WORDS) for _ in range(n)]
        count = None
        for _ in range(4):
            text = " ".join(words)
            got = await self._tok(text)
            if got is None:
                return text, None
            count = len(got)
            if count == n:
                break
            k = max(1, round(len(words) * n / count))
            words = words[:k] if k <= len(words) else words + [rng.choice(WORDS) for _ in range(k - len(words))]
        return " ".join(words), count


def _lens(mean: int, ratio: float, count: int, rng: random.Random) -> list[int]:
    """vLLM's random-dataset lengths: uniform integers in [mean * (1 - ratio), mean * (1 + ratio)]."""
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


async def build(args, maker: TextMaker, num: int, seed: int) -> list[Item]:
    """`num` requests of the chosen dataset (shared-prefix: ceil(num / turns) conversations, num turns in all)."""
    rng = random.Random(seed)
    if args.dataset == "jsonl":
        items = load_jsonl(args.dataset_path, num, args.output_len, override=args.output_len_given)
        if args.endpoint != "chat" and any(i.messages is not None for i in items):
            raise SystemExit(f"{args.dataset_path}: lines of 'messages' need --endpoint chat")
        return items
    in_len, out_len = args.input_len, args.output_len
    if args.dataset == "long":
        in_len = in_len if args.input_len_given else LONG_PRESET["input_len"]
        out_len = out_len if args.output_len_given else LONG_PRESET["output_len"]
    if args.dataset == "shared-prefix":
        return await _shared_prefix(args, maker, num, rng, in_len, out_len)
    ins, outs = _lens(in_len, args.range_ratio, num, rng), _lens(out_len, args.range_ratio, num, rng)
    seeds = [rng.getrandbits(64) for _ in range(num)]
    texts = await asyncio.gather(*(maker.text(n, random.Random(s)) for n, s in zip(ins, seeds, strict=True)))
    return [Item([t], o, prompt_lens=[c]) for (t, c), o in zip(texts, outs, strict=True)]


async def _shared_prefix(args, maker: TextMaker, num: int, rng, in_len: int, out_len: int) -> list[Item]:
    system, _ = await maker.text(args.prefix_len, random.Random(rng.getrandbits(64)))
    turns = max(1, args.num_turns)
    sizes = [min(turns, num - i) for i in range(0, num, turns)]
    ins = _lens(in_len, args.range_ratio, num, rng)
    texts = await asyncio.gather(*(maker.text(n, random.Random(rng.getrandbits(64))) for n in ins))
    out, k = [], 0
    for size in sizes:
        chunk = texts[k : k + size]
        out.append(Item([t for t, _ in chunk], out_len, system=system, prompt_lens=[c for _, c in chunk]))
        k += size
    return out


def load_jsonl(path: str | Path, num: int, default_out: int, override: bool = False) -> list[Item]:
    """Lines of {"prompt": str} or {"messages": [...]}, optionally with "max_tokens" (other keys, such as a task
    name, are ignored); cycled to `num` items. A line's max_tokens wins over `default_out` unless `override`."""
    if not path:
        raise SystemExit("--dataset jsonl needs --dataset-path")
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        mt = default_out if override else int(row.get("max_tokens") or row.get("output_len") or default_out)
        if isinstance(row.get("prompt"), str):
            items.append(Item([row["prompt"]], mt, prompt_lens=[None]))
        elif isinstance(row.get("messages"), list):
            items.append(Item([], mt, messages=row["messages"], prompt_lens=[None]))
        else:
            raise SystemExit(f"{path}:{n}: needs a string 'prompt' or a list 'messages'")
    if not items:
        raise SystemExit(f"{path}: no requests")
    return [items[i % len(items)] for i in range(num)]
