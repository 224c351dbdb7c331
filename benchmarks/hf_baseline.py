"""The transformers baseline of the benchmarks: finding an interpreter with torch + transformers (the project's venv has
neither), starting a benchmark file in it as a worker subprocess, and loading the benchmarked weights there.

The worker side (`load_model`) imports only torch and transformers, so it runs in that interpreter, where netra_jax
(and jax) are not installed; the benchmark scripts import this file from benchmarks/ on both sides.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

__all__ = ["find_hf_python", "load_model", "start_worker"]


def find_hf_python(explicit: str | None) -> str | None:
    """The baseline's interpreter: `explicit`, else $NETRA_HF_PYTHON, else benchmarks/.hfvenv, else $NETRA_JAX_CACHE
    (default ~/.cache/netra_jax)/hfvenv, else the current interpreter if it imports torch and transformers; None when
    none is found."""
    cands = [explicit, os.environ.get("NETRA_HF_PYTHON"), str(HERE / ".hfvenv" / "bin" / "python")]
    cache = os.environ.get("NETRA_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "netra_jax"
    )
    cands.append(os.path.join(cache, "hfvenv", "bin", "python"))
    for c in cands:
        if c and os.access(c, os.X_OK):
            return c
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        return sys.executable
    except ImportError:
        return None


def start_worker(python: str, script: str, arg: str, stderr) -> subprocess.Popen:
    """`python script --hf-worker arg`, offline (no hub access, no progress bars), talking JSON lines over its stdin
    and stdout."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    return subprocess.Popen(
        [python, script, "--hf-worker", arg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )


def load_model(path: str | Path, **kwargs):
    """The float32 transformers model of a Hugging Face directory or a .gguf file (de-quantized to float32 by
    transformers' GGUF loader: the weights netra_jax's loader produces), in eval mode. `kwargs` go to
    `from_pretrained` (e.g. attn_implementation). Worker side: needs torch, transformers (and gguf for .gguf)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    where = path.parent if kw else path
    return AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kw, **kwargs).eval()
