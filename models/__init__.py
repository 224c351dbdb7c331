"""Pure model functions over a parameter pytree (installed as `netra_jax.models`): `transformer.forward` for every
family, variants chosen by `netra_jax.config.ModelConfig`'s flags, and `weight_map`, the table every loader reads.

Also `rope`, `moe`, `hooks` (interventions inside the forward), `lora` (LoRA adapters and their slots), `head_parallel`
(attention under tensor parallelism) and `weight_reads`. Modules are imported by name: this package exports nothing
itself."""
