"""Compiled programs as files: one program serialized to bytes and back (`dump`, `restore`: jax's `serialize` /
`deserialize_and_load`, pickled and lzma-compressed; `engine.bundle` writes its programs so), and the store a server
keeps its programs in between starts (`ProgramStore`). A file is code: load only files this machine wrote."""

from __future__ import annotations

import hashlib
import json
import logging
import lzma
import pickle
import threading
from pathlib import Path

import jax

__all__ = ["ProgramStore", "digest", "dump", "key_text", "restore"]

log = logging.getLogger(__name__)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def key_text(key: tuple) -> str:
    """A program's key (`ModelRunner.programs`) as text."""
    return repr(key)


def dump(compiled: jax.stages.Compiled, preset: int = 6) -> bytes:
    """A compiled program as the bytes of one file (serialized, pickled, lzma-compressed)."""
    from jax.experimental import serialize_executable

    return lzma.compress(pickle.dumps(serialize_executable.serialize(compiled)), preset=preset)


def restore(payload: bytes) -> jax.stages.Compiled:
    """The program `dump` wrote, loaded onto this machine's device."""
    from jax.experimental import serialize_executable

    return serialize_executable.deserialize_and_load(*pickle.loads(lzma.decompress(payload)))


class ProgramStore:
    """One engine configuration's compiled programs kept on this machine between a server's starts: under `root`, a
    directory per signature (`bundle.engine_signature`), a file per program named by a digest of its key. A warm start
    loads the programs found there without tracing or lowering them (what a start on jax's persistent compilation
    cache spends most of its time on), and a start that compiles writes what it compiled; jax's cache stays beneath
    it for everything else. A file that cannot be read counts as missing and is removed; one that cannot be
    written is left out (logged)."""

    def __init__(self, root: str | Path, sig: dict[str, str]) -> None:
        self.dir = Path(root) / digest(json.dumps(sig, sort_keys=True))
        self._sig = sig

    def _path(self, key: tuple) -> Path:
        return self.dir / f"{digest(key_text(key))}.xz"

    def has(self, key: tuple) -> bool:
        return self._path(key).is_file()

    def load(self, key: tuple) -> jax.stages.Compiled | None:
        """The stored program of `key`, or None (not stored, or unreadable: then removed)."""
        path = self._path(key)
        try:
            return restore(path.read_bytes())
        except FileNotFoundError:
            return None
        except Exception as e:  # damaged, truncated, or refused by this runtime: compile instead
            log.warning("stored program %s unreadable, compiling it instead: %s", path, type(e).__name__)
            path.unlink(missing_ok=True)
            return None

    def save(self, key: tuple, compiled: jax.stages.Compiled) -> None:
        """Store `compiled` under `key` (atomically: a reader sees a whole file or none)."""
        path = self._path(key)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            sig = self.dir / "signature.json"
            if not sig.exists():
                sig.write_text(json.dumps(self._sig, indent=1) + "\n")
            tmp = path.with_suffix(f".{threading.get_native_id()}.tmp")
            tmp.write_bytes(dump(compiled, preset=1))
            tmp.replace(path)
        except Exception as e:  # a full disk, a read-only cache, an executable that does not serialize
            log.warning("cannot store the compiled program %s: %s: %s", key_text(key), type(e).__name__, e)
