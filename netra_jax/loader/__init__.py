"""Checkpoint loading: `load_model` turns a Hugging Face directory or a GGUF file into (ModelConfig, params) through
the orbax parameter cache; `read_gguf_metadata` exposes a GGUF file's tokenizer and chat-template fields.

dtype="auto" rule: a HF directory keeps its config's `torch_dtype`/`dtype` when that is float32 or bfloat16
(float16 becomes bfloat16; a config naming none takes the floating dtype holding most of the safetensors bytes, else
float32); a GGUF file, de-quantized to float32 first, is float32 on the
CPU backend (exact against float32 references, and XLA's CPU bf16 matmuls are slow) and bfloat16 on accelerators.
Norm weights are always float32.

Tensor parallel (`mesh` given): a HF directory is read straight onto the mesh, each device reading only its slices
from the memory maps (`parallel.load_hf_sharded`; the parameter cache is bypassed, as there is no conversion to
save). A GGUF file's kept blocks are sliced per device the same way (output rows, or whole blocks along K); a file
without kept blocks, or loaded with keep_quantized=False, is de-quantized whole (through the cache as usual) and
then placed on the mesh, each device receiving its slice.

GGUF quantization: the Linear weights, the per-expert MoE weights and the embedding of a GGUF file stay in their
GGML blocks when their type is one the runtime reads as it is (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K:
`ops.ggml_blocks`), as `quant.GGMLWeight`s, read tensor by tensor without the parameter cache; the other tensors
(norms, the router, other types, gpt-oss's fused experts) are de-quantized to the dtype. "dtype" is then the compute
dtype.

Hugging Face quantized checkpoints (`quantization_config` of FP8, AWQ, GPTQ or compressed-tensors: `loader.hf_quant`)
are read the same way, on one device and without the parameter cache: each quantized Linear weight (and lm_head)
kept as stored, in its `netra_jax.quant` weight, the other tensors read as floats in the dtype."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from netra_jax import parallel
from netra_jax.config import ConfigError, ModelConfig
from netra_jax.loader import cache as param_cache
from netra_jax.loader import dummy, gguf_loader, gguf_names, hf, hf_quant, mxfp4
from netra_jax.loader.errors import CheckpointError
from netra_jax.loader.gguf_config import config_from_gguf_metadata
from netra_jax.loader.gguf_loader import GGUFFile, is_gguf_file, read_gguf_metadata
from netra_jax.loader.hf import HFCheckpoint, stored_float_dtype
from netra_jax.models import weight_map, weight_reads
from netra_jax.options import DTYPES, LOAD_FORMATS, TASKS

__all__ = [
    "CheckpointError",
    "abstract_params",
    "ConfigError",
    "load_model",
    "load_config",
    "quantization_method",
    "read_gguf_metadata",
    "DTYPES",
    "LOAD_FORMATS",
]
_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
log = logging.getLogger(__name__)


def _resolve_dtype(dtype: str, source_dtype: str | None, is_gguf: bool) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if is_gguf:
        return "float32" if jax.default_backend() == "cpu" else "bfloat16"
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}.get(source_dtype or "", "float32")


def _open_source(
    path: str | Path, trust_remote_code: bool = False
) -> tuple[ModelConfig, GGUFFile | dict[str, Any], list[Path]]:
    """(config, source, source files): the source is a GGUFFile (header parsed, tensors not read) or the HF
    config dict. Raises FileNotFoundError, CheckpointError or ConfigError."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if p.is_dir():
        cfg = ModelConfig.from_hf_dir(p, trust_remote_code=trust_remote_code)
        d = json.loads((p / "config.json").read_text())
        hf_quant.scheme(d.get("quantization_config"), p)  # a method or option not read fails here, in one line
        files = [p / "config.json", *sorted(p.glob("*.safetensors"))]
        if (p / "model.safetensors.index.json").is_file():
            files.append(p / "model.safetensors.index.json")
        return cfg, d, files
    if not is_gguf_file(p):
        raise CheckpointError(f"{p} is neither a Hugging Face model directory nor a GGUF (.gguf) file")
    gf = GGUFFile(p)
    rope_freqs = gf.tensor("rope_freqs.weight") if "rope_freqs.weight" in gf.tensors else None
    shapes = {n: t.shape for n, t in gf.tensors.items()}
    return config_from_gguf_metadata(gf.metadata, shapes, rope_freqs), gf, [p]


def _load_kept(
    get,
    has,
    cfg: ModelConfig,
    dtype,
    without: tuple[str, ...],
    drop_pages,
    mesh: jax.sharding.Mesh | None = None,
    layout: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """The parameters whose quantized weights (a GGUF file's GGML blocks in the kept formats: Linear weights, experts
    and the embedding; a quantized checkpoint's Linear weights) stay as stored (`weight_reads.BlocksLeaf` /
    `KeptLeaf`; the other tensors read as floats in `dtype`), read tensor by tensor: each parameter goes to the
    device as soon as it is read and the file pages it touched are dropped (`drop_pages`), so the process holds about
    the quantized bytes once. A tied lm_head shares a kept embedding's blocks. mesh: each device receives only its
    slice of every parameter (blocks sliced by rows or by whole blocks along K, see `quant.shard_specs`; KV heads
    replicated as `parallel.shard_params` does). layout: applied to each parameter as it is placed (see
    `load_model`)."""
    tp = parallel.tp_size(mesh)
    reader = weight_map.WeightReader(cfg, get, has, dtype, without, keep_quantized=True)
    leaves = reader.leaves(parallel.kv_replicas(cfg, tp))
    kept = weight_reads.BlocksLeaf
    tied = cfg.tie_word_embeddings and isinstance(leaves.get("embed"), kept) and isinstance(leaves.get("lm_head"), kept)
    if tied:  # the table's blocks, read once (on a mesh the head's split is the table's: vocab rows, K whole)
        leaves.pop("lm_head")

    def put(leaf, spec=None):
        if mesh is not None:
            value = parallel.place_leaf(leaf, spec, mesh)
        else:
            value = jax.tree.map(jax.numpy.asarray, leaf.read_all())  # one copy: the file's pages to the device
        drop_pages()
        return value if layout is None else layout(value)

    is_leaf = lambda x: isinstance(x, parallel.LEAVES)  # noqa: E731
    if mesh is None:
        params = jax.tree.map(put, leaves, is_leaf=is_leaf)
    else:  # the specs first: a split the blocks cannot take is refused before anything is read
        params = jax.tree.map(put, leaves, weight_map.param_specs(leaves, cfg, tp), is_leaf=is_leaf)
    if tied:
        params["lm_head"] = params["embed"].replace(transposed=True)  # the same buffer
    return params


def quantization_method(path: str | Path) -> str | None:
    """The `quant_method` of a Hugging Face checkpoint read as it is stored (one of `hf_quant.METHODS`), else None
    (a float checkpoint, gpt-oss's mxfp4 experts, a GGUF file); CheckpointError for a method that is not read."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return None
    sch = hf_quant.scheme(json.loads((p / "config.json").read_text()).get("quantization_config"), p)
    return None if sch is None else sch.method


def load_config(path: str | Path, *, trust_remote_code: bool = False) -> ModelConfig:
    """ModelConfig of a HF directory or GGUF file, without reading any weights (trust_remote_code: see
    `ModelConfig.from_hf_dict`)."""
    return _open_source(path, trust_remote_code)[0]


def abstract_params(
    path: str | Path, dtype: str = "auto", *, trust_remote_code: bool = False
) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the parameter pytree `load_model` gives a float Hugging Face checkpoint, or `load_format="dummy"`,
    as jax.ShapeDtypeStruct leaves): what programs over the model are compiled against, read from config.json alone
    (no weight is read). CheckpointError for a GGUF file or a quantized checkpoint, whose weights keep their stored
    formats and layouts."""
    cfg, source, _ = _open_source(path, trust_remote_code)
    if isinstance(source, GGUFFile) or hf_quant.scheme(source.get("quantization_config"), path) is not None:
        raise CheckpointError(
            f"{path}: only float Hugging Face checkpoints have a layout known without reading them (a GGUF file or "
            "a quantized checkpoint keeps its stored formats)"
        )
    src_dtype = source.get("torch_dtype") or source.get("dtype") or stored_float_dtype(path)
    dt = _resolve_dtype(dtype, src_dtype, False)
    return cfg, dummy.param_layout(cfg, _NP_DTYPES[dt], optional=dummy.attention_biases(cfg, source))


def load_model(
    path: str | Path,
    dtype: str = "auto",
    cache: bool | str | Path = True,
    mesh: jax.sharding.Mesh | None = None,
    load_format: str = "auto",
    task: str = "generate",
    trust_remote_code: bool = False,
    keep_quantized: bool = True,
    layout: Callable[[Any], Any] | None = None,
) -> tuple[ModelConfig, dict[str, Any]]:
    """Load a model: (ModelConfig, parameter pytree of jax arrays as `models.transformer.forward` takes it).

    path: a HF directory (config.json + *.safetensors) or a .gguf file. dtype: "auto" | "float32" | "bfloat16"
    (see the module docstring for "auto"). cache: True for the default cache directory
    (`assets.cache_dir() / "params"`), a directory to use instead, or False to always convert from the source.
    mesh: a ("tp",) mesh from `parallel.make_mesh` to load the parameters sharded over (see the module docstring).
    load_format: "auto" reads the weights; "dummy" reads only config.json of a HF directory and draws random
    parameters of the same layout on the device (`loader.dummy`, for benchmarks).
    task: "generate", or "embed" to leave the lm_head out (embedding checkpoints often have none; the pooled hidden
    states never need it; not with a mesh yet). trust_remote_code: load a checkpoint whose config.json has an
    auto_map with the native implementation of its architecture (see `ModelConfig.from_hf_dict`).
    keep_quantized: keep a GGUF file's GGML blocks in the kept formats (see the module docstring); False
    de-quantizes every tensor to `dtype`, as for a file of other types (e.g. to quantize the model another way).
    A quantized Hugging Face checkpoint is always read as stored (False is refused). layout: a function of one
    parameter applied to each kept-quantized one as soon as it is placed (a matmul backend's re-lay,
    `quant.leaf_layout`), so that the stored and the re-laid forms of the whole model are never held together."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    without = ("lm_head",) if task == "embed" else ()
    if without and mesh is not None:
        raise ValueError("task 'embed' does not support tensor parallelism yet (load it on one device)")
    t0 = time.perf_counter()
    cfg, source, files = _open_source(path, trust_remote_code)
    is_gguf = isinstance(source, GGUFFile)
    src_dtype = None if is_gguf else (source.get("torch_dtype") or source.get("dtype") or stored_float_dtype(path))
    dt = _resolve_dtype(dtype, src_dtype, is_gguf)
    if load_format == "dummy":
        if is_gguf:
            raise CheckpointError(f"load_format='dummy' needs a Hugging Face directory (config.json), not {path}")
        if mesh is not None:
            parallel.check_tp(cfg, parallel.tp_size(mesh))
        params = dummy.random_params(cfg, _NP_DTYPES[dt], mesh, optional=dummy.attention_biases(cfg, source))
        log.info("random (dummy) %s parameters for %s in %.2fs", dt, path, time.perf_counter() - t0)
        return cfg, params
    scheme = None if is_gguf else hf_quant.scheme(source.get("quantization_config"), path)
    if scheme is not None:
        if not keep_quantized:
            raise CheckpointError(f"{path} is a {scheme.method} checkpoint, read as stored; it is not de-quantized")
        if mesh is not None:
            raise CheckpointError(f"{path}: a {scheme.method} checkpoint is not supported with tensor parallelism yet")
        ck = HFCheckpoint(path)
        get, has = hf_quant.view(ck, scheme)
        params = _load_kept(get, has, cfg, _NP_DTYPES[dt], without, ck.drop_pages, layout=layout)
        log.info(
            "loaded %s (%s, %s weights kept quantized) in %.2fs", path, dt, scheme.describe(), time.perf_counter() - t0
        )
        return cfg, params
    if mesh is not None:
        parallel.check_tp(cfg, parallel.tp_size(mesh))
        if not is_gguf:
            ck = HFCheckpoint(path)
            params = parallel.load_hf_sharded(ck.get, ck.has, cfg, _NP_DTYPES[dt], mesh)
            log.info(
                "loaded %s (%s) sharded %d ways in %.2fs", path, dt, parallel.tp_size(mesh), time.perf_counter() - t0
            )
            return cfg, params
    if is_gguf and keep_quantized and source.kept_tensors():
        get, has = gguf_names.hf_view(source, cfg)
        params = _load_kept(get, has, cfg, _NP_DTYPES[dt], without, source.drop_pages, mesh, layout)
        how = "" if mesh is None else f", sharded {parallel.tp_size(mesh)} ways"
        log.info("loaded %s (%s, GGML blocks kept quantized%s) in %.2fs", path, dt, how, time.perf_counter() - t0)
        return cfg, params
    root = key = None
    if cache:
        try:
            root = param_cache.default_root() if cache is True else Path(cache)
            code = [m.__file__ for m in (weight_map, weight_reads, hf, mxfp4, gguf_loader, gguf_names)]
            key = param_cache.cache_key(files, "-without-".join((dt, *without)), code_files=code)
        except OSError as e:  # e.g. an unwritable cache directory: load without the cache
            log.warning("parameter cache unavailable (%s); converting %s", e, path)
            root = None
        params = param_cache.load_params(root, key) if root is not None else None
        if params is not None:
            log.info("loaded %s (%s) from the parameter cache in %.2fs", path, dt, time.perf_counter() - t0)
            return cfg, params if mesh is None else parallel.shard_params(params, cfg, mesh)
    if is_gguf:
        get, has = gguf_names.hf_view(source, cfg)
    else:
        ck = HFCheckpoint(path)
        get, has = ck.get, ck.has
    params_np = weight_map.hf_to_params(cfg, get, has, _NP_DTYPES[dt], without)
    if root is not None:
        param_cache.save_params(root, key, params_np, tied_lm_head=cfg.tie_word_embeddings)
    params = jax.tree.map(jax.numpy.asarray, params_np) if mesh is None else parallel.shard_params(params_np, cfg, mesh)
    log.info("converted %s (%s) in %.2fs", path, dt, time.perf_counter() - t0)
    return cfg, params
