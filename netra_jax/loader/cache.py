"""On-disk cache of converted parameter pytrees (orbax-checkpoint, tensorstore arrays + JSON metadata, no pickles),
keyed by the source files' identity, the dtype and the conversion code, so a second start skips de-quantization.

Layout: `<root>/<key>/manifest.json` (leaf paths, shapes, dtypes) and `<root>/<key>/params/` (orbax checkpoint).
An entry is written under a temporary name and renamed into place, so readers only ever see complete entries and
concurrent writers of the same key race harmlessly (the loser discards its copy)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from netra_jax import assets

FORMAT_VERSION = 1
MAX_ENTRIES = 4  # least recently used entries beyond this are removed after each save
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0  # temporary entries older than this are left-overs of a killed writer
log = logging.getLogger(__name__)


def default_root() -> Path:
    return assets.cache_dir() / "params"


def cache_key(sources: Iterable[str | Path], dtype: str, code_files: Iterable[str | Path] = ()) -> str:
    """Hex key of (format version, each source's resolved path, size and mtime, dtype, conversion code content)."""
    h = hashlib.sha256(f"netra-params-v{FORMAT_VERSION}|{dtype}".encode())
    for s in sorted(str(Path(p).resolve()) for p in sources):
        st = os.stat(s)
        h.update(f"|src:{s}:{st.st_size}:{st.st_mtime_ns}".encode())
    for c in sorted(str(Path(p).resolve()) for p in code_files):
        h.update(b"|code:" + hashlib.sha256(Path(c).read_bytes()).digest())
    return h.hexdigest()[:32]


# The parameter pytree is {"embed", "lm_head", "final_norm", "layers": [dict, ...]} with optional per-layer keys.
# It is stored flat ("layers.3.wq" -> array); the manifest records every leaf so restore rebuilds it exactly.
def _flatten(params: dict[str, Any]) -> dict[str, Any]:
    flat = {}
    for k, v in params.items():
        if k == "layers":
            for i, lp in enumerate(v):
                for name, a in lp.items():
                    flat[f"layers.{i}.{name}"] = a
        elif isinstance(v, dict | list):
            raise TypeError(f"unexpected nested parameter group {k!r}")
        else:
            flat[k] = v
    return flat


def _unflatten(flat: dict[str, Any], num_layers: int) -> dict[str, Any]:
    params: dict[str, Any] = {"layers": [{} for _ in range(num_layers)]}
    for key, a in flat.items():
        if key.startswith("layers."):
            _, i, name = key.split(".", 2)
            params["layers"][int(i)][name] = a
        else:
            params[key] = a
    return params


def _orbax_tree(flat: dict[str, Any]) -> dict[str, Any]:
    # orbax joins tree paths with dots when naming arrays; keep the flat keys free of them
    return {k.replace(".", "__"): v for k, v in flat.items()}


def _checkpointer():
    import orbax.checkpoint as ocp

    # synchronous, uncompressed: restoring zstd-compressed weights took about 4x longer than reading them raw
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def save_params(root: str | Path, key: str, params: dict[str, Any], *, tied_lm_head: bool = False) -> Path | None:
    """Write `params` as cache entry `key` (best effort: failures are logged, never raised). With `tied_lm_head`
    the lm_head (a transposed copy of the embedding) is not stored but rebuilt on restore."""
    import orbax.checkpoint as ocp

    root = Path(root)
    final = root / key
    if final.is_dir():
        return final
    tmp = root / f"{_TMP_PREFIX}{key}-{uuid.uuid4().hex[:8]}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(root)
        flat = _flatten(params)
        tied_lm_head = tied_lm_head and flat.pop("lm_head", None) is not None
        leaves = {k: {"shape": list(np.shape(a)), "dtype": str(a.dtype)} for k, a in flat.items()}
        tmp.mkdir()
        with _checkpointer() as ckptr:
            ckptr.save(tmp / "params", args=ocp.args.PyTreeSave(_orbax_tree(flat)))
        manifest = {
            "format": FORMAT_VERSION,
            "num_layers": len(params["layers"]),
            "tied_lm_head": bool(tied_lm_head),
            "leaves": leaves,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        try:
            os.rename(tmp, final)
        except OSError:  # another writer finished first; its entry is equivalent
            shutil.rmtree(tmp, ignore_errors=True)
        _prune(root, keep=final)
        return final if final.is_dir() else None
    except Exception as e:  # a cache must never break loading
        log.warning("could not write the parameter cache entry %s: %s", final, e)
        shutil.rmtree(tmp, ignore_errors=True)
        return None


def load_params(root: str | Path, key: str) -> dict[str, Any] | None:
    """Restore cache entry `key` as a pytree of jax arrays on the default device, or None when absent.
    A damaged entry is logged and removed (the caller converts from the source again)."""
    import orbax.checkpoint as ocp

    entry = Path(root) / key
    if not entry.is_dir():
        return None
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        if manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"format {manifest.get('format')} != {FORMAT_VERSION}")
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = {
            k: jax.ShapeDtypeStruct(tuple(m["shape"]), np.dtype(m["dtype"]), sharding=sharding)
            for k, m in manifest["leaves"].items()
        }
        tree = _orbax_tree(target)
        restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
        with _checkpointer() as ckptr:
            restored = ckptr.restore(
                entry / "params", args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args)
            )
        flat = {k: restored[k.replace(".", "__")] for k in target}
        params = _unflatten(flat, int(manifest["num_layers"]))
        if manifest.get("tied_lm_head"):
            params["lm_head"] = jax.numpy.transpose(params["embed"])
        os.utime(entry / "manifest.json")  # last use, for pruning
        return params
    except Exception as e:
        log.warning("discarding unreadable parameter cache entry %s: %s", entry, e)
        _discard(entry)
        return None


def _discard(entry: Path) -> None:
    # rename first so a concurrent reader never sees a half-deleted entry under the live name
    trash = entry.with_name(f"{_TMP_PREFIX}trash-{entry.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _prune(root: Path, keep: Path) -> None:
    """Remove the least recently used entries (manifest mtime) beyond MAX_ENTRIES, never `keep`."""

    def last_use(p: Path) -> float:
        try:
            return (p / "manifest.json").stat().st_mtime
        except OSError:
            return 0.0

    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")), key=last_use)
    for p in entries[: max(0, len(entries) - MAX_ENTRIES)]:
        if p != keep:
            _discard(p)


def _remove_stale_tmp(root: Path) -> None:
    now = time.time()
    for p in root.glob(f"{_TMP_PREFIX}*"):
        try:
            if now - p.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
