"""The OpenAI-compatible HTTP server and batch jobs (installed as `netra_jax.serving`): `app.create_app` (FastAPI
routes over an AsyncEngine), `cli.serve` (`netra-jax serve`), `protocol` (the request and response models).

Batch jobs: `batch` (one engine), `batch_ray` (Ray Data), `batch_cli` (`netra-jax batch`); replicas: `ray_serve`.
Modules are imported by name: this package exports nothing itself."""
