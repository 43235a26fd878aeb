"""Small matrix products on XLA:CPU: x [rows, in] times twelve [out, in] weights (out of cache),
as Linear multiplies them: the plain product (x @ w.T) against `matmul_t` (on CPU, up to
COLUMN_DOT_MAX_ROWS rows: w @ x.T behind an optimization barrier, then transposed). float32, or
int8 x int8 -> int32 as w8a8 multiplies (--dtype int8).

  python -m benchmarks.cpu_small_products [--rows 1 2 3 4 8 16 32 64] [--dtype int8]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.matmul import COLUMN_DOT_MAX_ROWS, matmul_t

ACCUMULATE = {"float32": None, "int8": jnp.int32}


def median_ms(fn, x, weights, repeats: int = 10) -> float:
    jax.block_until_ready(fn(x, weights))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, weights))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def random(key, shape, dtype: str):
    if dtype == "int8":
        return jax.random.randint(key, shape, -127, 128, jnp.int8)
    return jax.random.normal(key, shape, jnp.float32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64])
    p.add_argument("--shape", type=int, nargs=2, default=[8192, 768], help="each weight's [out, in]")
    p.add_argument("--dtype", choices=tuple(ACCUMULATE), default="float32")
    args = p.parse_args(argv)
    acc = ACCUMULATE[args.dtype]
    weights = [random(jax.random.key(i), args.shape, args.dtype) for i in range(12)]
    megabytes = 12 * sum(w.nbytes for w in weights[:1]) / 1e6

    def plain(x, w):
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=acc)

    def columns(x, w):
        return matmul_t(x, w, preferred_element_type=acc)
    products = {name: jax.jit(lambda x, ws, f=f: [f(x, w) for w in ws]) for name, f in
                (("plain", plain), ("matmul_t", columns))}
    print(f"{jax.devices()[0].device_kind}: 12 weights of {args.shape} {args.dtype} ({megabytes:.0f} MB); "
          f"matmul_t by columns up to {COLUMN_DOT_MAX_ROWS} rows")
    print("rows | plain ms | matmul_t ms | plain / matmul_t")
    for rows in args.rows:
        x = random(jax.random.key(99), (rows, args.shape[1]), args.dtype)
        ms = {name: min(median_ms(f, x, weights) for _ in range(2)) for name, f in products.items()}
        print(f"{rows:4d} | {ms['plain']:8.1f} | {ms['matmul_t']:11.1f} | {ms['plain'] / ms['matmul_t']:.2f}x")


if __name__ == "__main__":
    main()
