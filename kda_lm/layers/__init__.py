"""Haiku layers of the hybrid KDA + MLA decoder, one module per concern."""

from kda_lm.layers.conv import ShortConvolution
from kda_lm.layers.kda import KimiDeltaAttention
from kda_lm.layers.linear import Dense
from kda_lm.layers.mla import MultiHeadLatentAttention
from kda_lm.layers.mlp import SwiGLU
from kda_lm.layers.norm import GatedRMSNorm, RMSNorm

__all__ = [
    "Dense",
    "GatedRMSNorm",
    "KimiDeltaAttention",
    "MultiHeadLatentAttention",
    "RMSNorm",
    "ShortConvolution",
    "SwiGLU",
]
