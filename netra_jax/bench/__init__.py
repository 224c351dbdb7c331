"""Benchmark clients shipped with the runtime: `netra-jax bench serve` (netra_jax.bench.serve), a load generator for
any OpenAI-compatible server, with its request sets (datasets), plots (plot) and `netra-jax serve` launcher (launch)."""
