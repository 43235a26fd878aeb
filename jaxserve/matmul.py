"""x @ w.T for a weight stored [out, in] (PyTorch's layout, every Linear's), in the form XLA:CPU
runs fastest for few rows of x.

XLA:CPU streams an f32 weight at ~26 GB/s for one row of x, but at ~15 GB/s for 2-32 rows,
where it packs the weight for a general matrix product. The same product taken as w @ x.T (one
pass over w per row block, as for one row), kept by a barrier from being folded back and
transposed after, is 1.6-1.7x faster at 2-16 rows and 1.2x at 32 (768 x 8192 f32 weights, the
2-core dev box), equal from 64. w8a8's int8 x int8 -> int32 product gains the same way at 2-8
rows: 1.4-1.5x on twelve [8192, 768] int8 weights (3.2-3.9 ms against 4.5-5.6 ms for 75 MB),
1.2-1.8x on [768, 8192], and none from 16 rows (`python -m benchmarks.cpu_small_products
--dtype int8`; its one-row product is a slow path either way, which w8a8 avoids by doubling the
row). Steps of small decode batches and speculative verify rows (1 + k tokens each) are such
products. Other platforms keep the plain product.
"""
import math

import jax
import jax.numpy as jnp

COLUMN_DOT_MAX_ROWS = {"float": 32, "int8": 8}   # by the weight's dtype


def matmul_t(x, w, preferred_element_type=None):
    """x [..., in] @ w.T for a weight w [out, in]: [..., out] (accumulated in
    preferred_element_type, as lax.dot_general)."""
    def plain(x, w):
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())),
                                   preferred_element_type=preferred_element_type)

    rows = math.prod(x.shape[:-1])
    if rows > COLUMN_DOT_MAX_ROWS["int8" if w.dtype == jnp.int8 else "float"]:
        return plain(x, w)

    def by_columns(x, w):
        y = jax.lax.dot_general(w, x.reshape(rows, x.shape[-1]), (((1,), (1,)), ((), ())),
                                preferred_element_type=preferred_element_type)   # [out, rows]
        return jax.lax.optimization_barrier(y).T.reshape(*x.shape[:-1], w.shape[0])

    return jax.lax.platform_dependent(x, w, cpu=by_columns, default=plain)
