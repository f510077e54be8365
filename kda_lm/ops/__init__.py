"""Kernels and ops. `chunk_kda` is the single entry point for KDA."""

from kda_lm.ops.kda.api import chunk_kda

__all__ = ["chunk_kda"]
