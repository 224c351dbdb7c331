"""The one `matmul` every projection runs through, for float and quantized weights alike: the chosen backend's
kernels first, the jnp reference (`quant.reference`) for any product they do not take."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from netra_jax.quant import gpu, repack
from netra_jax.quant.cpu_rows import cpu_invariant_matmul, cpu_rows_matmul, cpu_rows_q8_matmul
from netra_jax.quant.reference import reference_matmul
from netra_jax.quant.weights import GGMLWeight, PermutedWeight, is_quantized

# A backend kernel: (x, w, spec, preferred_element_type) -> x @ w, or None when it does not take the product.
Kernel = Callable[..., jax.Array | None]

# Backend name -> its kernels, tried in order before the reference. "xla": the reference alone (XLA's dot over
# weights de-quantized in jnp); "cpu_rows": the CPU few-row FFI kernels for decode-sized float32 products;
# "cpu_rows_q8": the same with GGML Q4_0 ... Q8_0, Q4_K and Q5_K products on int8 activations (llama.cpp's
# arithmetic); "cpu_invariant": every product on the CPU kernels whatever the number of rows, each output summed in
# order (batch-invariant; ValueError for weights they do not read); "gpu": the Pallas W4A16 / W8A16 kernel for
# PackedIntWeight and W8A8 on XLA's fp8 dot for fp8 weights (CUDA GPUs with fp8, sm89+); "gpu_sm80": the Pallas
# kernel, fp8 weights as W8A16 (the reference); "gpu_interpret": the Pallas kernel in the interpreter (CPU tests).
BACKENDS: dict[str, tuple[Kernel, ...]] = {
    "xla": (),
    "cpu_rows": (cpu_rows_matmul,),
    "cpu_rows_q8": (cpu_rows_q8_matmul,),
    "cpu_invariant": (cpu_invariant_matmul,),
    "gpu": (gpu.packed_matmul, gpu.fp8_w8a8_matmul),
    "gpu_sm80": (gpu.packed_matmul,),
    "gpu_interpret": (gpu.packed_matmul_interpret,),
}
GPU_BACKENDS = ("gpu", "gpu_sm80")  # the backends whose kernels need a CUDA GPU
CPU_BACKENDS = ("cpu_rows", "cpu_rows_q8", "cpu_invariant")  # the backends whose kernels are the CPU FFI library's
# Batch-invariant backends: a row's result never depends on the other rows of the call, and the forward sums its
# norms and mixture-of-experts outputs in a fixed order too (`netra_jax.ops.invariant`): the engine's option
# batch_invariant and `netra_jax.rl.sequence_logprobs` run it.
ROW_INVARIANT = ("cpu_invariant",)
MATMULS = tuple(BACKENDS)
# Backend name -> the layout its kernels read a weight in (a function of one parameter, returning it as it is when
# it needs nothing), applied once at load (`leaf_layout` as each parameter is placed, `weight_layout` over a tree);
# backends not listed read the weights as loaded.
LAYOUTS: dict[str, Callable[[Any], Any]] = {
    **{name: repack.gpu_weight for name in (*GPU_BACKENDS, "gpu_interpret")},
    **{name: repack.cpu_weight for name in CPU_BACKENDS},
    "cpu_rows_q8": repack.cpu_q8_weight,
}


def leaf_layout(backend: str) -> Callable[[Any], Any] | None:
    """The function re-laying one parameter for `backend`'s kernels (LAYOUTS), or None when it reads them as loaded.
    Applying it again to a re-laid parameter changes nothing."""
    return LAYOUTS.get(backend)


def weight_layout(params: dict, backend: str) -> dict:
    """`params` in the layout `backend`'s kernels read (LAYOUTS; as they are for the others). A matmul weight sharing
    its blocks with a table (a tied lm_head: the embedding's) keeps them as they are, shared."""
    layout = leaf_layout(backend)
    if layout is None:
        return params
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    tables = {id(w.data) for w in leaves if isinstance(w, GGMLWeight) and not w.transposed}
    shared = lambda w: isinstance(w, GGMLWeight) and id(w.data) in tables  # noqa: E731
    return jax.tree.map(lambda w: w if shared(w) else layout(w), params, is_leaf=is_quantized)


def matmul(x: jax.Array, w, spec: str | None = None, preferred_element_type=None, backend: str = "xla") -> jax.Array:
    """x @ w for a float or quantized weight (`quant.weights`); `spec` is an einsum spec for weights with several
    output axes; backend: one of MATMULS."""
    kernels = BACKENDS.get(backend)
    if kernels is None:
        raise ValueError(f"unknown matmul backend {backend!r}; available: {', '.join(MATMULS)}")
    if isinstance(w, PermutedWeight):  # the kernels read the stored rows; x follows their order
        x, w = w.inputs_in_stored_order(x, spec), w.stored
    for kernel in kernels:
        if (y := kernel(x, w, spec, preferred_element_type)) is not None:
            return y
    return reference_matmul(x, w, spec, preferred_element_type)
