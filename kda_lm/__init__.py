"""kda-lm: hybrid MLA + KDA language models in JAX and Haiku."""
