"""The loader's error: every reader (safetensors, GGUF, their quantized formats) raises it for a checkpoint it cannot
read, so callers catch one type. A leaf module: the readers import it, it imports none of them."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or of a refused kind."""
