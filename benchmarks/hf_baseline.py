"""The transformers baseline of the benchmarks: finding an interpreter with torch + transformers (the project's venv has
neither), starting a benchmark module in it as a worker subprocess, and loading the benchmarked weights there.

The worker side (`load_model`) imports only torch and transformers, so it runs in that interpreter, where netra_jax
(and jax) are not installed; the benchmark modules import this one as `benchmarks.hf_baseline` on both sides (the
worker gets the repository root on its PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

__all__ = ["BaselineWorker", "find_hf_python", "load_model", "start_worker", "worker_env"]


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


def worker_env() -> dict[str, str]:
    """This process's environment with the repository root first on PYTHONPATH, so that `python -m benchmarks.<name>`
    imports in another interpreter from any working directory."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


def start_worker(python: str, module: str, arg: str, stderr) -> subprocess.Popen:
    """`python -m module --hf-worker arg`, offline (no hub access, no progress bars), talking JSON lines over its
    stdin and stdout."""
    env = dict(worker_env(), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1")
    return subprocess.Popen(
        [python, "-m", module, "--hf-worker", arg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )


class BaselineWorker:
    """A benchmark module's worker (`start_worker`) as a long-lived subprocess, so its runs interleave with ours under
    the same load: the job goes to it as a JSON file, each command gets one JSON line back, and its stderr is kept
    for the error message."""

    def __init__(self, python: str, module: str, job: dict):
        self.dir = tempfile.TemporaryDirectory()
        inp = os.path.join(self.dir.name, "job.json")
        Path(inp).write_text(json.dumps(job))
        self.err = open(os.path.join(self.dir.name, "stderr.txt"), "w+")
        self.python = python
        self.proc = start_worker(python, module, inp, self.err)

    def ask(self, cmd: str | None) -> dict:
        """Send {"cmd": cmd} (None: send nothing) and read the worker's next line."""
        if cmd is not None:
            self.proc.stdin.write(json.dumps({"cmd": cmd}) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            raise RuntimeError(f"the baseline worker ({self.python}) failed: {self.err.read()[-3000:]}")
        return json.loads(line)

    def close(self) -> dict:
        """Send "quit" and return the worker's last line with the interpreter; the worker is waited for."""
        try:
            return dict(self.ask("quit"), python=self.python)
        finally:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.err.close()
            self.dir.cleanup()


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
