"""The GPU compile check (python -m gpu_compile): see __main__.py."""
