"""Where the tests' checkpoints and reference data live: the transformers-made fixtures in ../shared/fixtures (or
$NETRA_JAX_FIXTURES), this suite's own data in tests/fixtures, and each fixture's reference.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(os.environ.get("NETRA_JAX_FIXTURES", REPO.parent / "shared" / "fixtures"))
DATA = REPO / "tests" / "fixtures"  # this suite's own checkpoints, GGUF files and references
TINY_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-gemma3"]
MOE_MODELS = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"]  # mixture-of-experts fixtures


def reference(name: str) -> dict:
    """The transformers reference (logits, greedy ids, prompts) stored beside fixture `name`."""
    return json.loads((FIXTURES / name / "reference.json").read_text())
