"""Quantized weights and the one `matmul` that reads them: pytree weight types (`weights`), online quantization of a
float checkpoint (`online`), the jnp reference (`reference`) and the backends' kernels behind one entry point
(`matmul`, with the layout each backend reads the weights in, `repack` for the GPU's)."""

from netra_jax.quant.matmul import BACKENDS, GPU_BACKENDS, LAYOUTS, MATMULS, matmul, weight_layout
from netra_jax.quant.online import METHODS, QUANTIZABLE, quantize_params, quantize_q4_0, quantize_weight
from netra_jax.quant.reference import reference_matmul
from netra_jax.quant.weights import (
    QUANTIZED_TYPES,
    GGMLWeight,
    PackedIntWeight,
    QuantizedWeight,
    embedding_rows,
    is_quantized,
)

__all__ = [
    "BACKENDS",
    "GPU_BACKENDS",
    "LAYOUTS",
    "MATMULS",
    "METHODS",
    "QUANTIZABLE",
    "QUANTIZED_TYPES",
    "GGMLWeight",
    "PackedIntWeight",
    "QuantizedWeight",
    "embedding_rows",
    "is_quantized",
    "matmul",
    "quantize_params",
    "quantize_q4_0",
    "quantize_weight",
    "reference_matmul",
    "weight_layout",
]
