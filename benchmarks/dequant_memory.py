"""Device memory of a step whose weights are dequantized in the graph (INT4 above
`kernels.INT_MATMUL_MAX_ROWS` rows), with and without `kernels.after` tying each weight to its
layer's input: the compiled program's temporary bytes, from XLA's memory analysis.

    python -m benchmarks.dequant_memory [--layers 32] [--rows 8192] [--k 4096] [--n 14336]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from pallasite import kernels
from pallasite.kernels import w4a16_matmul as im


def temp_bytes(layers: int, rows: int, k: int, n: int, tied: bool) -> int:
    def step(x, words, scales):
        for w, s in zip(words, scales):
            if tied:
                x, w = kernels.after(x, w)
            d = im.dequantize(w, s, None, bits=4, group_size=128, k=k).astype(x.dtype)
            x = jax.nn.silu(x @ d)[:, :k]  # back to K columns for the next layer
        return x
    x = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
    words = [jax.ShapeDtypeStruct((k // 8, n), jnp.int32)] * layers
    scales = [jax.ShapeDtypeStruct((k // 128, n), jnp.float32)] * layers
    compiled = jax.jit(step).lower(x, words, scales).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    a = ap.parse_args(argv)
    one = a.k * a.n * 2
    for tied in (False, True):
        t = temp_bytes(a.layers, a.rows, a.k, a.n, tied)
        print(json.dumps(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                              layers=a.layers, rows=a.rows, k=a.k, n=a.n, tied=tied,
                              temp_gb=round(t / 1e9, 3), dequantized_weights=round(t / one, 2))),
              flush=True)


if __name__ == "__main__":
    main()
