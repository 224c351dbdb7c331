"""F32 copy of a GGUF file (for comparisons against other engines on the exact weights netra-jax runs): every tensor
de-quantized with the gguf package, as netra-jax's loader does, and all metadata copied (general.file_type = ALL_F32).

Usage: `python -m netra_jax.bench.gguf_f32 IN.gguf OUT.gguf`, or `python -m netra_jax.bench.gguf_f32 --default` to
write the default model's F32 copy next to the cached Q4_1 file (skipped when it exists) and print its path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

F32_FILE_TYPE = 0  # llama_ftype ALL_F32


def to_f32(src: str | Path, dst: str | Path) -> Path:
    """Write `dst`: `src` with every tensor as F32. Written to a temporary name first, then renamed."""
    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".part")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise ValueError(f"{src}: big-endian GGUF files are not supported")
    writer = gguf.GGUFWriter(tmp, arch)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if f.name == gguf.Keys.General.ALIGNMENT:
            writer.add_custom_alignment(int(f.contents()))
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = F32_FILE_TYPE if f.name == gguf.Keys.General.FILE_TYPE else f.contents()
        writer.add_key_value(f.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(dst)
    return dst


def default_f32() -> Path:
    """The default model's F32 copy (SmolLM2-135M-Instruct.F32.gguf beside the Q4_1 file), written once."""
    from netra_jax.assets import cache_dir, default_model_path

    src = default_model_path(quiet=True)
    name = src.name.replace(".Q4_1.gguf", ".F32.gguf")
    dst = (src.parent if src.parent.is_relative_to(cache_dir()) else cache_dir() / "smollm2") / name
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {dst} (F32 copy of {src}) ...", file=sys.stderr, flush=True)
        to_f32(src, dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m netra_jax.bench.gguf_f32", description=__doc__.split("\n\n")[0])
    p.add_argument("src", nargs="?")
    p.add_argument("dst", nargs="?")
    p.add_argument("--default", action="store_true", help="the default model's F32 copy (path printed)")
    a = p.parse_args(argv)
    if a.default:
        print(default_f32())
        return 0
    if not (a.src and a.dst):
        p.error("give IN.gguf OUT.gguf, or --default")
    print(to_f32(a.src, a.dst))
    return 0


if __name__ == "__main__":
    sys.exit(main())
