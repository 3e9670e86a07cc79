"""The batch-invariant matrix product (`kernels/invariant_matmul.py`) in interpret mode: against
its float32-accumulated reference, and each row's bits the same whatever the call's M, mode
(split-K or segments in a loop) and tiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import invariant_matmul as im
from pallasite.kernels import tuning


def operands(seed, m, k, n, layout):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = rng.standard_normal((n, k) if layout == "nk" else (k, n)) / np.sqrt(k)
    return x, jnp.asarray(w, jnp.bfloat16)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_matches_reference_and_rows_do_not_depend_on_the_call(layout):
    x, w = operands(0, 70, 3 * 1024, 128, layout)  # three segments; 70 rows pad to two blocks
    ref = np.asarray(im.reference(x, w, layout=layout, out_dtype=jnp.float32))
    calls = [dict(split=True), dict(split=False), dict(split=True, block_m=128, block_n=64),
             dict(split=False, block_n=32, num_warps=8), dict(split=False, flat=True)]
    outs = [np.asarray(im.invariant_matmul(x, w, layout=layout, out_dtype=jnp.float32,
                                           interpret=True, **c)) for c in calls]
    assert np.linalg.norm(outs[0] - ref) / np.linalg.norm(ref) < 1e-5
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    for m in (1, 5):  # a decode step's rows, alone
        few = im.invariant_matmul(x[:m], w, layout=layout, out_dtype=jnp.float32,
                                  interpret=True)
        np.testing.assert_array_equal(np.asarray(few), outs[0][:m])


def test_bf16_output_and_segments():
    assert [im.segment_k(k) for k in (4096, 14336, 768, 192, 40)] == [1024, 1024, 256, 64, 0]
    assert im.takes(4096, 128256) and not im.takes(40, 64) and not im.takes(4096, 100)
    x, w = operands(1, 3, 768, 64, "kn")  # 768: three 256-key segments
    out = im.invariant_matmul(x, w, interpret=True)
    assert out.dtype == jnp.bfloat16 and out.shape == (3, 64)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(im.reference(x, w), np.float32), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="differ in K"):
        im.invariant_matmul(x, w.T, interpret=True)


def test_entry_takes_the_kernel_only_when_batch_invariant():
    x, w = operands(2, 4, 1024, 64, "kn")
    plain = kernels.matmul(x[None], w)  # leading axes kept
    assert plain.shape == (1, 4, 64)
    with tuning.batch_invariant():
        inv = kernels.matmul(x[None], w, interpret=True, out_dtype=jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(inv[0]), np.asarray(im.invariant_matmul(x, w, out_dtype=jnp.float32,
                                                           interpret=True)))
