"""The GPU compile check (python -m benchmarks.gpu_compile): see __main__.py."""
