"""Kernels, each beside its plain-jnp reference: `attention` (ragged paged attention, every backend), the C++ CPU
kernels (`cpu_matmul`, `cpu_attention`, `cpu_decode_layer`, built by `cpu_kernels`), Pallas GPU kernels, `sampling`.

Also `kv_quant` (int8 / fp8 KV pages) and the quantized matmuls' kernels (`packed_matmul_triton`, `fp8_matmul`,
`cpu_ggml_matmul`). Modules are imported by name: this package exports nothing itself."""
