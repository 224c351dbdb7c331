"""Quantized weights in the parameter pytree and the one `matmul` every projection runs through: per-output-channel
weight-only int8 or fp8 (`QuantizedWeight`: symmetric scales, (x @ q) * scale, exact per output channel) and GGML
blocks (`GGMLWeight`: a GGUF file's Q4_0 ... Q6_K tensors as they are, or online int4 as Q4_0), de-quantized inside
the matmul's kernel, or by `ops.ggml_blocks`' jnp reference for the products no kernel takes. Norms and biases stay
in float.

Online methods (`quantize_params`, `--quantization`): "int8" (int8, scale amax / 127 per output channel), "fp8"
(float8_e4m3fn, scale amax / 448 per output channel; on CPU the product runs on XLA, de-quantized first), "int4"
(llama.cpp's Q4_0: blocks of 32 input values with an fp16 scale, llama.cpp's rounding; a weight whose input size is
not a multiple of 32 stays in float)."""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from netra_jax.ops import cpu_ggml_matmul, cpu_matmul, ggml_blocks

# Expert weights (experts_gate_up [E, hidden, 2, I], experts_down [E, I, hidden]) and the router stay in float:
# `quantize_weight` takes scales over axis 0, which for them is the expert axis, not the input axis; int8 experts need
# per-expert scales [E, *out] applied after the grouped matmul (models/moe.py), which it does not do.
QUANTIZABLE = ("wq", "wk", "wv", "wo", "w_gate_up", "w_down")
METHODS = ("int8", "int4", "fp8")
_CHANNEL_FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # storage dtype, largest value


@flax.struct.dataclass
class QuantizedWeight:
    q: jax.Array  # [in, *out] int8 or float8_e4m3fn
    scale: jax.Array  # [*out] float32, one per output channel

    @property
    def shape(self):
        return self.q.shape


@flax.struct.dataclass
class GGMLWeight:
    """A GGUF tensor kept in its GGML blocks: data uint8 [rows, row_bytes], each row K values in K / QK blocks of
    `qtype` (exactly the file's bytes). It stands for a float parameter of logical `shape`:
    - transposed=True: a matmul weight [K, *out] (our [in, out] layout; rows = prod(out), the output features);
    - transposed=False: a table [rows, K] read by rows (the token embedding).
    `dtype`: the float dtype it de-quantizes to (the model's compute dtype)."""

    data: jax.Array  # [rows, row_bytes] uint8
    qtype: str = flax.struct.field(pytree_node=False)
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    transposed: bool = flax.struct.field(pytree_node=False, default=True)
    dtype: jnp.dtype = flax.struct.field(pytree_node=False, default=jnp.dtype(jnp.float32))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def rows(self, idx: jax.Array | None = None) -> jax.Array:
        """The de-quantized rows [rows, K] (or only rows `idx`, e.g. token ids: [*idx.shape, K]) in `dtype`."""
        data = self.data if idx is None else self.data[idx]
        return ggml_blocks.dequantize_rows(data, self.qtype, self.dtype)

    def dequantize(self) -> jax.Array:
        """The float parameter it stands for, of `shape` (the reference: jnp de-quantization of every block)."""
        r = self.rows()  # [rows, K]
        return r.T.reshape(self.shape) if self.transposed else r.reshape(self.shape)


def embedding_rows(table, ids: jax.Array) -> jax.Array:
    """table[ids] of an embedding table [vocab, hidden], float or GGML blocks (only the rows of `ids` are
    de-quantized)."""
    return table.rows(ids) if isinstance(table, GGMLWeight) else table[ids]


@functools.partial(jax.jit, static_argnums=1)  # one program per weight shape, not one per operation
def quantize_weight(w: jax.Array, method: str = "int8") -> QuantizedWeight:
    """Per-output-channel symmetric int8 or fp8 (`method`) of a weight stored [in, *out] (the input axis is 0)."""
    dtype, top = _CHANNEL_FORMATS[method]
    wf = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(wf), axis=0)  # [*out]
    scale = jnp.where(amax > 0, amax / top, 1.0)
    if method == "int8":
        q = jnp.clip(jnp.round(wf / scale), -top, top).astype(dtype)
    else:  # fp8 rounds to nearest in the cast; |w / scale| <= 448, e4m3's largest finite value
        q = (wf / scale).astype(dtype)
    return QuantizedWeight(q=q, scale=scale.astype(jnp.float32))


def quantize_q4_0(w: jax.Array) -> GGMLWeight | None:
    """A weight [in, *out] as Q4_0 blocks along its input axis (`GGMLWeight`, de-quantizing to w's dtype), or None
    when its input size is not a multiple of 32."""
    if w.shape[0] % ggml_blocks.FORMATS["Q4_0"].qk:
        return None
    return GGMLWeight(_q4_0_rows(w), "Q4_0", tuple(w.shape), True, jnp.dtype(w.dtype))


@jax.jit
def _q4_0_rows(w: jax.Array) -> jax.Array:
    rows = w.reshape(w.shape[0], -1).T.astype(jnp.float32)  # [prod(out), in]: a row per output feature
    return ggml_blocks.quantize_rows_q4_0(rows)


def quantize_params(params: dict, method: str = "int8") -> dict:
    """Quantize every projection of every layer and the lm_head (when loaded) by `method` (one of METHODS, see the
    module docstring); everything else, and weights already quantized (a GGUF file's blocks), is kept as it is."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")

    def q(name: str, v):
        if name not in QUANTIZABLE or isinstance(v, (GGMLWeight, QuantizedWeight)):
            return v
        if method == "int4":
            blocks = quantize_q4_0(v)
            return v if blocks is None else blocks
        return quantize_weight(v, method)

    layers = [{k: q(k, v) for k, v in lp.items()} for lp in params["layers"]]
    out = {**params, "layers": layers}
    if "lm_head" in params:  # embedding-only parameters have none
        out["lm_head"] = q("wq", params["lm_head"])
    return out


MATMULS = ("xla", "cpu_rows")  # how float matmuls run: XLA's dot, or the CPU few-row kernel where it takes them


def _rows_form(spec: str | None, x: jax.Array, w) -> bool:
    """Whether x @ w (with `spec`) contracts x's last axis with w's first and keeps the rest in order: a plain
    [M, K] @ [K, N] once w's output axes are flattened."""
    if x.ndim != 2:
        return False
    if spec is None:
        return w.ndim == 2
    ins, out = spec.split("->")
    xs, ws = ins.split(",")
    return len(ws) == w.ndim and xs[1] == ws[0] and out == xs[0] + ws[1:]


def _on_rows_kernel(x: jax.Array, w: jax.Array, spec: str | None) -> jax.Array | None:
    """x @ w on `cpu_matmul`'s few-row kernels when the product has their plain form and they take it (float32 x,
    decode-sized, w float32 or int8: preferred_element_type changes nothing), else None."""
    if not _rows_form(spec, x, w):
        return None
    w2 = w.reshape(w.shape[0], -1)  # [K, prod(out)]
    if not cpu_matmul.takes(x, w2):
        return None
    return cpu_matmul.rows_matmul(x, w2).reshape(x.shape[0], *w.shape[1:])


def matmul(x: jax.Array, w, spec: str | None = None, preferred_element_type=None, backend: str = "xla") -> jax.Array:
    """x @ w for a float or quantized weight; `spec` is an einsum spec for weights with several output axes.
    backend: one of MATMULS; "cpu_rows" runs float32 matmuls of few rows, and int8 weights' float32 matmuls of few
    rows, on `netra_jax.ops.cpu_matmul`'s kernels."""
    if backend not in MATMULS:
        raise ValueError(f"unknown matmul backend {backend!r}; available: {', '.join(MATMULS)}")
    if isinstance(w, GGMLWeight):
        return _ggml_matmul(x, w, spec, preferred_element_type, backend)
    if isinstance(w, QuantizedWeight):
        if backend == "cpu_rows" and (y := _on_rows_kernel(x, w.q, spec)) is not None:
            return y * w.scale  # the int8 weights read as they are
        wq = w.q.astype(x.dtype)
        y = (
            jnp.einsum(spec, x, wq, preferred_element_type=preferred_element_type)
            if spec
            else jnp.dot(x, wq, preferred_element_type=preferred_element_type)
        )
        return y * w.scale.astype(y.dtype)
    w = w.astype(x.dtype)
    if backend == "cpu_rows" and (y := _on_rows_kernel(x, w, spec)) is not None:
        return y
    if spec:
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    return jnp.dot(x, w, preferred_element_type=preferred_element_type)


def _ggml_matmul(x: jax.Array, w: GGMLWeight, spec: str | None, preferred_element_type, backend: str) -> jax.Array:
    """x @ w for GGML blocks: the CPU block kernel for few float32 rows in the plain form, else the reference (the
    blocks de-quantized to x's dtype, then XLA's dot with the rows contracted on their K axis)."""
    if not w.transposed:
        raise ValueError(f"a {w.qtype} table read by rows (an embedding) is not a matmul weight")
    if _rows_form(spec, x, w):
        if backend == "cpu_rows" and cpu_ggml_matmul.takes(x, w.data, w.qtype):
            y = cpu_ggml_matmul.blocks_matmul(x, w.data, w.qtype)  # [M, rows] float32
        else:
            r = ggml_blocks.dequantize_rows(w.data, w.qtype, x.dtype)  # [rows, K]
            y = jax.lax.dot_general(x, r, (((1,), (1,)), ((), ())), preferred_element_type=preferred_element_type)
        return y.reshape(x.shape[0], *w.shape[1:])
    wf = w.dequantize().astype(x.dtype)
    if spec:
        return jnp.einsum(spec, x, wf, preferred_element_type=preferred_element_type)
    return jnp.dot(x, wf, preferred_element_type=preferred_element_type)
