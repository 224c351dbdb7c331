"""Quantized weights and the one `matmul` that reads them: pytree weight types (`weights`), online quantization of a
float checkpoint (`online`), the jnp reference (`reference`) and the backends' kernels behind one entry point
(`matmul`, with the layout each backend reads the weights in: `repack`, GPU and CPU)."""

from netra_jax.quant.matmul import (
    BACKENDS,
    CPU_BACKENDS,
    GPU_BACKENDS,
    LAYOUTS,
    MATMULS,
    ROW_INVARIANT,
    leaf_layout,
    matmul,
    weight_layout,
)
from netra_jax.quant.online import BATCH_DIMS, METHODS, QUANTIZABLE, quantize_params, quantize_q4_0, quantize_weight
from netra_jax.quant.reference import reference_matmul
from netra_jax.quant.weights import (
    QUANTIZED_TYPES,
    BlockFP8Weight,
    GGMLWeight,
    PackedIntWeight,
    PermutedWeight,
    QuantizedWeight,
    concatenate_outputs,
    embedding_rows,
    is_quantized,
    shard_specs,
)

__all__ = [
    "BACKENDS",
    "BATCH_DIMS",
    "CPU_BACKENDS",
    "GPU_BACKENDS",
    "LAYOUTS",
    "MATMULS",
    "METHODS",
    "QUANTIZABLE",
    "QUANTIZED_TYPES",
    "ROW_INVARIANT",
    "BlockFP8Weight",
    "GGMLWeight",
    "PackedIntWeight",
    "PermutedWeight",
    "QuantizedWeight",
    "concatenate_outputs",
    "embedding_rows",
    "is_quantized",
    "leaf_layout",
    "matmul",
    "quantize_params",
    "quantize_q4_0",
    "quantize_weight",
    "reference_matmul",
    "shard_specs",
    "weight_layout",
]
