"""The grouped (mixture-of-experts) matmul kernel in Pallas interpret mode against
`lax.ragged_dot` and the reference SwiGLU experts: empty experts, rows past the groups' total,
one expert taking everything, bf16."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import kernels
from pallasite.kernels import grouped_matmul as gm
from pallasite.kernels.reference import grouped_mlp_reference


def random_sizes(rng, m, groups, total=None):
    total = m if total is None else total
    cuts = np.sort(rng.integers(0, total + 1, groups - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


@pytest.mark.parametrize("m,groups,k,n,total,block_m,dtype", [
    (40, 4, 128, 256, None, 16, jnp.float32),
    (70, 8, 64, 128, 50, 64, jnp.float32),    # 20 rows past the groups: zeros
    (33, 5, 128, 128, None, 16, jnp.bfloat16),
])
def test_grouped_matmul_equals_ragged_dot(m, groups, k, n, total, block_m, dtype):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.normal(size=(m, k)), dtype)
    w = jnp.asarray(rng.normal(size=(groups, k, n)) / np.sqrt(k), dtype)
    sizes = jnp.asarray(random_sizes(rng, m, groups, total))
    sizes = sizes.at[1].set(0).at[0].add(sizes[1])  # always one empty expert
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    got = gm.grouped_matmul(x, w, sizes, block_m=block_m, interpret=True)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


def test_padding_layout_and_empty_blocks():
    sizes = jnp.asarray([3, 0, 17, 0], jnp.int32)
    x = jnp.arange(20 * 8, dtype=jnp.float32).reshape(20, 8) + 1
    x_pad, dest, block_group = gm.pad_groups(x, sizes, 16)
    # group 0 in block 0, group 2 in blocks 1-2, the rest of the blocks empty
    assert block_group.tolist()[:3] == [0, 2, 2] and set(block_group.tolist()[3:]) == {-1}
    np.testing.assert_array_equal(x_pad[dest], x)
    w = jnp.ones((4, 8, 128), jnp.float32)
    y = gm.grouped_matmul_padded(x_pad, w, block_group, block_k=8, interpret=True)
    assert not np.asarray(y[48:]).any()  # empty blocks are written, with zeros


def test_grouped_mlp_dispatch_equals_reference():
    rng = np.random.default_rng(3)
    m, e, d, f = 48, 6, 128, 256
    x = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    wg, wu = (jnp.asarray(rng.normal(size=(e, d, f)) * 0.1, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(e, f, d)) * 0.1, jnp.float32)
    sizes = jnp.asarray(random_sizes(rng, m, e))
    got = kernels.grouped_mlp(x, sizes, wg, wu, wd, interpret=True)
    np.testing.assert_allclose(got, grouped_mlp_reference(x, sizes, wg, wu, wd), rtol=1e-5,
                               atol=1e-5)
