"""The blockwise jnp ragged attention (the CPU serving path) against the reference."""

import numpy as np
import pytest

from pallasite.kernels import ragged_jnp, reference
from test_kernels import RAGGED_CASES, paged_case, rel_err


@pytest.mark.parametrize("case", RAGGED_CASES)
@pytest.mark.parametrize("pages_per_block", [1, 3])
def test_blockwise_equals_reference(case, pages_per_block):
    q_lens, cached, H, KV, D, page_size, pad = case[:7]
    q, kp, vp, qs, ctx, table = paged_case(sum(q_lens) + len(cached), q_lens, cached, H, KV, D,
                                           page_size, pad_tokens=pad)
    out = ragged_jnp.ragged_paged_attention(q, kp, vp, qs, ctx, table,
                                            pages_per_block=pages_per_block)
    ref = reference.ragged_paged_attention_reference(q, kp, vp, qs, ctx, table)
    assert rel_err(out, ref) < 1e-5
    assert np.all(np.asarray(out[int(qs[-1]):]) == 0)  # padding slots give zeros
