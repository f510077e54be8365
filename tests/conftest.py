"""Shared pytest setup.

`kda_lm` is imported first so that its XLA:CPU flags (see kda_lm/__init__.py)
are in place before any test initialises a JAX backend.
"""

import kda_lm  # noqa: F401  (side effect: XLA flags)
