"""Test-wide settings: float64 available for references, hypothesis profile for CI."""
import jax
from hypothesis import HealthCheck, settings

jax.config.update("jax_enable_x64", True)

settings.register_profile(
    "default", deadline=None, max_examples=25, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("default")
