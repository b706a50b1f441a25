"""Test-wide settings: the repository root after the installed packages on sys.path,
float64 available for references, hypothesis profile for CI, and a persistent compilation cache
private to this test process."""
import atexit
import os
import shutil
import sys
import tempfile

# `python -m pytest` puts the repository root first on sys.path. Its `kernels/` directory (the
# installed package's `palimpsa_jax.kernels`) would then shadow the `kernels` distribution that
# transformers (>= 5.25) imports; the root moves after the installed packages, where the tests
# still find `benchmarks` and `experiments`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_AT_ROOT = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _AT_ROOT] + _AT_ROOT

# Many tests compile the same programs again: every Trainer (one a run) jits its own steps, and a
# command run as a subprocess starts from nothing. JAX's persistent compilation cache, in a
# directory of this process alone (each pytest-xdist worker has its own), lets them load what
# an earlier test or run compiled instead of compiling it again. The subprocesses the tests start
# inherit it through the environment; they run while their test waits, so no two processes use
# the directory at once. The key of an entry is the program, the compile options and the devices,
# so what runs is exactly what a fresh compile would have produced.
_CACHE = tempfile.mkdtemp(prefix="palimpsa-test-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

settings.register_profile(
    "default", deadline=None, max_examples=25, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("default")
