"""One persistent XLA compilation cache for the whole run, in a fresh temporary folder.

Most of the suite's time is XLA compiling small engines' steps and samplers, and many tests
build the same programs (the same tiny configs, the same sampler shapes): with the cache each
distinct program compiles once per run. The folder is new for every run, so nothing carries over
between runs, and it is set through the environment before JAX is imported, so that the pytest
workers, child pytest runs and CLI processes the tests start all share it."""

import os
import shutil
import sys
import tempfile

# Before anything imports transformers: the root's folders (kernels/, model/, ...) go behind
# site-packages, so they hide no installed package of the same name (Hugging Face's `kernels`).
import benchmarks  # noqa: F401

_OWNER = "PALLASITE_TEST_CACHE_OWNER"

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="pallasite-xla-")
    os.environ[_OWNER] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The engine's warm-up keeps compiled programs in a per-user folder by default: the run's one
# instead, so the suite stays hermetic (a test that wants a cache of its own sets its folder).
os.environ.setdefault("PALLASITE_CACHE_DIR", os.environ["JAX_COMPILATION_CACHE_DIR"])
if "jax" in sys.modules:  # imported before this file (a plugin): its flags have read the env
    import jax
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    for name in ("min_compile_time_secs", "min_entry_size_bytes"):
        flag = f"jax_persistent_cache_{name}"
        jax.config.update(flag, type(getattr(jax.config, flag))(os.environ[flag.upper()]))


def pytest_unconfigure(config):
    if os.environ.get(_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
