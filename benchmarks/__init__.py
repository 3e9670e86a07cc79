"""Developer benchmarks (not installed), run from the repository root:
`python -m benchmarks.bench_kernels --out DIR`. Shared timing and records: `common.py`."""

import os
import sys

# Run from the root, its folders (kernels/, model/, ...) would hide installed packages of the
# same name (transformers imports Hugging Face's `kernels`): the root goes behind site-packages.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_at_root = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _at_root] + _at_root
