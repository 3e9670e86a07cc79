import os

# The engine's warm-up keeps compiled programs in a per-user folder by default; the suite stays
# hermetic (a test that wants the cache sets its own folder).
os.environ.setdefault("PALLASITE_CACHE_DIR", "")
