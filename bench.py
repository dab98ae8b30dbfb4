"""Benchmark the model's pieces on the current JAX backend; prints numbers, asserts nothing.

  python bench.py                          # record model, one 65,536-token forward+backward
  python bench.py --attention              # one attention layer fwd+bwd at windows 1, 7, 14 blocks
  python bench.py --seq-len 8192           # a shorter sequence

MFU counts 6 FLOPs per matmul weight per token plus attention (12·D·attended keys per layer,
fwd+bwd, documents ignored), against --peak-tflops (default: 989, H100 SXM dense bf16).
"""
import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import train_gpt as tg


def timed(fn, *args, repeats):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return compile_s, float(np.median(times))


def model_flops_per_token(hp, window_blocks):
    D, L = hp.model_dim, hp.num_layers
    attn_layers = [i for i in range(L) if tg.has_attention(i, L)]
    matmul_params = len(attn_layers) * 4 * D * D + L * 8 * D * D + hp.padded_vocab * D
    attended = sum((max(window_blocks if tg.has_long_window(i, L) else window_blocks // 2, 1) - 0.5) * tg.BLOCK
                   for i in attn_layers)
    return 6 * matmul_params + 12 * D * attended


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="record", choices=sorted(tg.PRESETS))
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--window", type=int, default=14, help="long window in blocks (short = half)")
    parser.add_argument("--no-fp8", action="store_true", help="bf16 head instead of the FP8 head")
    parser.add_argument("--attention", action="store_true", help="time one attention layer instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    hp = dataclasses.replace(tg.PRESETS[args.preset], seq_len=args.seq_len, batch_size=args.seq_len,
                             val_tokens=args.seq_len)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    rng = np.random.default_rng(0)
    T = args.seq_len
    tokens = rng.integers(0, hp.vocab_size, T + 1)
    tokens[rng.random(T + 1) < 1 / 1000] = tg.EOT  # documents of ~1000 tokens, like FineWeb's
    docs = jnp.asarray(np.cumsum(tokens[:-1] == tg.EOT), jnp.int32)

    if args.attention:
        H = hp.num_heads
        q, k, v = (jnp.asarray(rng.standard_normal((T, H, tg.HEAD_DIM)), jnp.bfloat16) for _ in range(3))

        def attn_fwd_bwd(q, k, v, window):
            return jax.grad(lambda q, k, v: jnp.sum(tg.block_sparse_attention(q, k, v, docs, window)
                                                    .astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

        for window in (1, 7, 14):
            compile_s, sec = timed(attn_fwd_bwd, q, k, v, jnp.int32(window), repeats=args.repeats)
            flops = 12 * hp.model_dim * (window - 0.5) * tg.BLOCK * T
            print(f"attention fwd+bwd T={T} heads={H} window={window}: {sec * 1e3:.1f} ms "
                  f"({flops / sec / 1e12:.2f} TFLOP/s; compile {compile_s:.1f}s)")
        return

    params = tg.init_params(hp, 0)
    inputs, targets = jnp.asarray(tokens[:-1], jnp.int32), jnp.asarray(tokens[1:], jnp.int32)

    def fwd_bwd(params, inputs, targets, window):
        return jax.value_and_grad(tg.loss_fn)(params, inputs, targets, window, True, not args.no_fp8)

    compile_s, sec = timed(fwd_bwd, params, inputs, targets, jnp.int32(args.window), repeats=args.repeats)
    flops = model_flops_per_token(hp, args.window) * T
    print(f"model fwd+bwd ({args.preset}, T={T}, window={args.window}, fp8={not args.no_fp8}): "
          f"{sec * 1e3:.1f} ms, {T / sec:,.0f} tokens/s, {flops / sec / 1e12:.2f} TFLOP/s, "
          f"MFU {flops / sec / 1e12 / args.peak_tflops:.1%} of {args.peak_tflops:.0f} TFLOP/s; compile {compile_s:.1f}s")


if __name__ == "__main__":
    main()
