"""Palimpsa-JAX: metaplastic attention models on top of the `kernels` compute core."""
