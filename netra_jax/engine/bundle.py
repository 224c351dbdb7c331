"""Compiled programs carried between machines: a directory holding one engine configuration's serialized executables
(jax's `serialize` / `deserialize_and_load`, each compressed), and a manifest naming what they were compiled for.

Contract: `signature` says everything a program depends on (jax and netra_jax's sources, the platform and device kind,
the model, its parameters' layout, the KV cache and every runner option). `write` compiles the engine's variants and
stores them with that signature; `load` compares the bundle's signature with the engine's own and, only if they are
equal, loads the programs into `ModelRunner.programs`, where the runner and the sampler find them. Failure paths: a
bundle that does not match, or cannot be read, loads nothing and says why in one line (`LoadReport.mismatch`): the
engine then compiles as usual. A bundle is code: load only bundles you made (unpickling runs what they hold)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from netra_jax.engine import program_store
from netra_jax.engine_config import EngineConfig

if TYPE_CHECKING:
    from netra_jax.engine.runner import ModelRunner
    from netra_jax.engine.warmup import Variant

__all__ = [
    "MANIFEST",
    "LoadReport",
    "device_name",
    "engine_signature",
    "load",
    "read_manifest",
    "signature",
    "sized_like",
    "write",
]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1  # the layout of the directory and its manifest
_PACKAGE = Path(__file__).resolve().parents[1]  # netra_jax/
# the code compiled programs are traced from: these subpackages and modules of netra_jax, and netra_jax.models
_TRACED = ("engine", "ops", "quant", "paged.py", "parallel.py", "config.py")


_digest = program_store.digest


def source_digest() -> str:
    """A digest of the sources compiled programs are traced from (`_TRACED`: the model functions, kernels, runner and
    sampler): a change to any of them makes older bundles stale."""
    import netra_jax.models

    paths = [_PACKAGE / name for name in _TRACED] + [Path(netra_jax.models.__file__).resolve().parent]
    h = hashlib.sha256()
    for top in paths:
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if path.suffix in (".py", ".cc", ".h"):
                h.update(path.name.encode())
                h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cpu_model() -> str:
    """The host CPU's model and instruction-set flags (XLA's CPU programs are compiled for the host's features)."""
    from netra_jax.bench.machine import cpuinfo_fields

    try:
        fields = cpuinfo_fields(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return platform.processor() or platform.machine()
    flags = " ".join(sorted(fields.get("flags", "").split()))
    return f"{fields.get('model name', platform.machine())} [{_digest(flags)}]"


def _leaves(tree) -> str:
    """Each leaf's path, shape and dtype, as one digest."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    parts = [f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{np.dtype(x.dtype).name}" for p, x in flat]
    return _digest(f"{treedef}|{'|'.join(parts)}")


def device_name(platform_name: str, device_kind: str) -> str:
    """The device programs are compiled for: a GPU's kind ("NVIDIA H100 80GB HBM3"), or the host CPU's model and
    instruction-set flags (XLA compiles CPU programs for the host's features)."""
    return _cpu_model() if platform_name == "cpu" else device_kind


def _attention_backend(runner: ModelRunner, platform_name: str, compute_capability: str | None) -> str:
    """The attention kernel the runner's steps run: "auto" resolved as the attention call resolves it on the device
    (`ops.attention.auto_backend`), so a runner built for a target's compile-only device, which names the kernel,
    and the engine on that device, which says "auto", agree."""
    if runner.backend != "auto":
        return runner.backend
    from netra_jax.ops.attention import auto_backend

    cfg = runner.cfg
    return auto_backend(
        platform_name,
        compute_capability,
        dtype=runner.params["embed"].dtype,
        kv_dtype=runner.kv.k[0].dtype,
        q_heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        page_size=runner.page_size,
    )


def signature(
    runner: ModelRunner,
    vocab_size: int,
    device_kind: str,
    platform_name: str,
    compute_capability: str | None = None,
) -> dict[str, str]:
    """What every program of `runner`'s engine depends on, as {field: value}; two engines with equal signatures
    call the same programs with the same arguments. device_kind, platform_name, compute_capability: the device the
    programs run on ("NVIDIA H100 80GB HBM3", "gpu", "9.0"; "cpu", "cpu", None: the host's CPU, see
    `device_name`)."""
    import jaxlib

    lora = runner.lora_config
    options = {
        "page_size": runner.page_size,
        "num_pages": runner.num_pages,
        "max_pages": runner.max_pages,
        "buckets": runner.buckets,
        "prompt_logprob_buckets": runner.prompt_logprob_buckets,
        "max_seqs_bucket": runner.max_seqs_bucket,
        "max_step_tokens": runner.max_step_tokens,
        "backend": _attention_backend(runner, platform_name, compute_capability),
        "matmul_backend": runner.matmul_backend,
        "overlap": runner.overlap,
        "num_spec_tokens": runner.num_spec_tokens,
        "max_spec_seqs": runner.max_spec_seqs,
        "tensor_parallel_size": 1 if runner.mesh is None else runner.mesh.size,
        "lora": None if lora is None else (lora.max_loras, lora.max_lora_rank),
    }
    return {
        "format": str(FORMAT),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "netra_jax_sources": source_digest(),
        "platform": platform_name,
        "device": device_name(platform_name, device_kind),
        "model": _digest(repr(runner.cfg)),
        "params": _leaves(runner.params),
        "kv_cache": _leaves(runner.kv),
        "vocab_size": str(vocab_size),
        "runner": json.dumps(options, sort_keys=True, default=str),
    }


def engine_signature(engine) -> dict[str, str]:
    """`signature` of a built engine, on the device it runs on."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    return signature(engine.runner, engine.vocab_size, dev.device_kind, jax.default_backend(), cc)


def sized_like(config: EngineConfig, manifest: dict) -> EngineConfig:
    """`config` with the bundle's KV page count (compiled into its programs) when `config` sizes the cache by memory
    (no page count or byte budget of its own) and the bundle was compiled for this kind of device, whose memory holds
    what the bundle was sized for; else `config` as it is."""
    cache = config.cache
    if cache.num_pages is not None or cache.kv_cache_bytes is not None:
        return config
    sig = manifest.get("signature") or {}
    here = jax.default_backend()
    if sig.get("platform") != here or sig.get("device") != device_name(here, jax.devices()[0].device_kind):
        return config
    pages = (_options(sig.get("runner")) or {}).get("num_pages")
    if not isinstance(pages, int) or pages < 2:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(cache, num_pages=pages))


_key_text = program_store.key_text


def write(
    out_dir: str | Path,
    variants: list[Variant],
    sig: dict[str, str],
    *,
    target: str,
    workers: int | None = None,
    progress: Callable[[str], None] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> dict:
    """Compile every variant (in `workers` threads, `engine.warmup.compile_variants`, with XLA `compiler_options`),
    serialize each into `out_dir/programs/`, and write the manifest with the signature `sig`; returns the manifest.
    Call it in a process without jax's persistent compilation cache: an executable read back from it does not
    serialize whole."""
    from netra_jax.engine.warmup import compile_variants

    out = Path(out_dir)
    (out / "programs").mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a half-written directory has no manifest
    rows: dict[int, dict] = {}
    lock = threading.Lock()
    index = {id(v): i for i, v in enumerate(variants)}

    def save(v: Variant, compiled: jax.stages.Compiled, seconds: float) -> None:
        i = index[id(v)]
        payload = program_store.dump(compiled)
        name = f"programs/{i:04d}-{v.kind}.xz"
        (out / name).write_bytes(payload)
        with lock:
            rows[i] = {"kind": v.kind, "label": v.label, "key": _key_text(v.key), "file": name}
            rows[i] |= {"bytes": len(payload), "compile_s": round(seconds, 2)}

    t0 = time.perf_counter()
    compile_variants(variants, workers=workers, progress=progress, on_compiled=save, compiler_options=compiler_options)
    manifest = {
        "format": FORMAT,
        "target": target,
        "signature": sig,
        "compiler_options": compiler_options or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "compile_seconds": round(time.perf_counter() - t0, 1),
        "programs": [rows[i] for i in sorted(rows)],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(bundle_dir: str | Path) -> dict:
    """The bundle's manifest; ValueError naming the problem when the directory holds none or a damaged one."""
    path = Path(bundle_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        why = f"{bundle_dir} is not a compiled bundle (no {MANIFEST}; `netra-jax compile` writes one)"
        raise ValueError(why) from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: not a bundle of format {FORMAT}")
    return manifest


@dataclass
class LoadReport:
    """What `load` did: programs loaded and the seconds it took, or why nothing was loaded."""

    loaded: int = 0
    seconds: float = 0.0
    mismatch: str | None = None  # one line: what differs, or what could not be read
    programs: list[str] = field(default_factory=list)  # the loaded programs' labels


def _options(text: str | None) -> dict | None:
    """The runner options of a signature's "runner" field, or None when it holds none."""
    try:
        options = json.loads(text or "")
    except json.JSONDecodeError:
        return None
    return options if isinstance(options, dict) else None


def differences(bundle: dict[str, str], engine: dict[str, str]) -> list[str]:
    """The signature fields that differ, each as "field (bundle X, this engine Y)"; of the runner's options, each
    option that differs ("runner.max_seqs_bucket (bundle 2, this engine 4)")."""
    out = []
    for k in sorted(set(bundle) | set(engine)):
        a, b = bundle.get(k), engine.get(k)
        if a == b:
            continue
        ours, theirs = (_options(a), _options(b)) if k == "runner" else (None, None)
        if ours is not None and theirs is not None and ours != theirs:
            for o in sorted(set(ours) | set(theirs)):
                x, y = ours.get(o), theirs.get(o)
                if x != y:
                    out.append(f"runner.{o} (bundle {json.dumps(x)}, this engine {json.dumps(y)})")
            continue
        short = (lambda v: v if v is None or len(v) <= 60 else _digest(v)) if k == "runner" else (lambda v: v)
        out.append(f"{k} (bundle {short(a)}, this engine {short(b)})")
    return out


def load(bundle_dir: str | Path, runner: ModelRunner, sig: dict[str, str], variants: list[Variant]) -> LoadReport:
    """Load the bundle's programs of `variants` into `runner.programs` when its signature equals `sig`; else (or
    when anything cannot be read) load none and say why in `LoadReport.mismatch`."""
    t0 = time.perf_counter()
    report = LoadReport()
    try:
        manifest = read_manifest(bundle_dir)
    except ValueError as e:
        report.mismatch = str(e)
        return report
    diff = differences(manifest.get("signature") or {}, sig)
    if diff:
        report.mismatch = f"compiled for another configuration: {'; '.join(diff)}"
        return report
    files = {row["key"]: row["file"] for row in manifest.get("programs", [])}
    loaded = {}
    try:
        for v in variants:
            name = files.get(_key_text(v.key))
            if name is None:
                continue
            loaded[v.key] = program_store.restore((Path(bundle_dir) / name).read_bytes())
            report.programs.append(f"{v.kind} ({v.label})")
    except Exception as e:  # a damaged or truncated file, or one the runtime refuses: compile instead
        report.mismatch = f"cannot load {name}: {type(e).__name__}: {str(e)[:300]}"
        report.programs = []
        return report
    runner.programs.update(loaded)
    report.loaded = len(loaded)
    report.seconds = time.perf_counter() - t0
    return report
