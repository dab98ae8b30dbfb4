"""§2 Model against the spec: init table, a float64 numpy re-implementation of the forward pass,
rotary, and the bf16 numerics against an fp32 run of the same model."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import train_gpt as tg

LN_V = np.log(50304)
SMALL = dataclasses.replace(tg.PRESETS["cpu"], model_dim=256, num_heads=2, seq_len=512)


def spec_table(D=768, L=12, V=50257):
    """record20.md §6, written out: name -> (shape, dtype)."""
    table = {"embed.weight": ((V, D), jnp.bfloat16), "skip_weights": ((L // 2,), jnp.float32),
             "lm_head.weight": ((50304, D), jnp.float32)}
    for k in range(3):
        table[f"value_embeds.embed.{k}.weight"] = ((V, D), jnp.bfloat16)
    for i in range(L):
        table[f"blocks.{i}.lambdas"] = ((2,), jnp.float32)
        if i != 7:
            table[f"blocks.{i}.attn.qkv_w"] = ((3, D, D), jnp.float32)
            table[f"blocks.{i}.attn.lambdas"] = ((2,), jnp.float32)
            table[f"blocks.{i}.attn.c_proj.weight"] = ((D, D), jnp.float32)
        table[f"blocks.{i}.mlp.c_fc.weight"] = ((4 * D, D), jnp.float32)
        table[f"blocks.{i}.mlp.c_proj.weight"] = ((D, 4 * D), jnp.float32)
    return table


def test_record_parameters_match_the_spec_table():
    shapes = jax.eval_shape(lambda: tg.init_params(tg.PRESETS["record"], 0))
    assert {k: (v.shape, v.dtype) for k, v in shapes.items()} == spec_table()
    n_params = sum(np.prod(v.shape) for v in shapes.values())
    assert abs(n_params - 275.6e6) < 0.2e6  # record20.md §1: ≈ 275.6M


def test_init_values():
    params = tg.init_params(SMALL, int(np.random.default_rng().integers(1 << 30)))
    D = SMALL.model_dim
    bound = 3**0.5 * 0.5 * D**-0.5
    for name, p in params.items():
        p = np.asarray(p, np.float32)
        if name.endswith(("c_proj.weight",)) or name == "lm_head.weight":
            assert np.all(p == 0), name
        elif name.endswith(("qkv_w", "c_fc.weight")):
            assert np.abs(p).max() <= bound and abs(p.std() - bound / 3**0.5) < 0.02 * bound, name
        elif name.startswith(("embed", "value_embeds")):
            assert abs(p.mean()) < 0.01 and abs(p.std() - 1) < 0.01, name
    assert np.all(np.asarray(params["blocks.3.lambdas"]) == [1, 0])
    assert np.all(np.asarray(params["blocks.3.attn.lambdas"]) == [0.5, 0.5])
    assert np.all(np.asarray(params["skip_weights"]) == 1)


def test_initial_loss_is_log_vocab():
    rng = np.random.default_rng()
    hp = dataclasses.replace(SMALL, num_layers=6)  # the zero head gives every layer count this loss
    params = tg.init_params(hp, 0)
    tokens = jnp.asarray(rng.integers(0, 50257, 2 * hp.seq_len), jnp.int32)
    # the training (FP8) head and the eval head, in one program
    losses = jax.jit(lambda p: [tg.loss_fn(p, tokens[::2], tokens[1::2], jnp.int32(2), t) for t in (True, False)])(params)
    for loss in losses:
        assert abs(float(loss) - LN_V) < 1e-3


# ---- an independent float64 numpy forward pass, written from record20.md §2


def reference_hidden(p, tokens, sw, skip_order="lifo"):
    L, D = 12, p["embed.weight"].shape[1]
    H, T = D // 128, len(tokens)
    eps = np.finfo(np.float32).eps
    rms = lambda x: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)  # noqa: E731
    docs = np.cumsum(tokens == 50256)
    pos = np.arange(T)
    freqs = np.concatenate([(1 / 1024) ** (np.arange(32) / 31), np.zeros(32)])
    theta = pos[:, None] * freqs[None]
    cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]

    def rope(x):
        x1, x2 = x[..., :64], x[..., 64:]
        return np.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], -1)

    def attend(q, k, v, W):
        allowed = (pos[None] <= pos[:, None]) & (docs[None] == docs[:, None]) & (pos[:, None] // 128 - pos[None] // 128 < W)
        s = np.einsum("qhd,khd->hqk", q, k) * 0.12
        s = np.where(allowed[None], s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("hqk,khd->qhd", e / e.sum(-1, keepdims=True), v)

    x0 = rms(p["embed.weight"][tokens])
    x, stack = x0, []
    for i in range(L):
        if i >= 6:
            skip = stack.pop() if skip_order == "lifo" else stack.pop(0)
            x = x + p["skip_weights"][i - 6] * skip
        x = p[f"blocks.{i}.lambdas"][0] * x + p[f"blocks.{i}.lambdas"][1] * x0
        if i != 7:
            a = f"blocks.{i}.attn."
            qkv = (rms(x) @ p[a + "qkv_w"].reshape(3 * D, D).T).reshape(T, 3 * H, 128)
            q, k, v = qkv[:, :H], qkv[:, H:2 * H], qkv[:, 2 * H:]
            ve = {0: 0, 1: 1, 2: 2, 9: 0, 10: 1, 11: 2}.get(i)
            v = p[a + "lambdas"][0] * v
            if ve is not None:
                v = v + p[a + "lambdas"][1] * p[f"value_embeds.embed.{ve}.weight"][tokens].reshape(T, H, 128)
            W = max(sw if i in (0, 4, 11) else sw // 2, 1)
            y = attend(rope(rms(q)), rope(rms(k)), v, W)
            x = x + y.reshape(T, D) @ p[a + "c_proj.weight"].T
        h = np.maximum(rms(x) @ p[f"blocks.{i}.mlp.c_fc.weight"].T, 0)
        x = x + (h * h) @ p[f"blocks.{i}.mlp.c_proj.weight"].T
        if i < 6:
            stack.append(x)
    return rms(x)


def randomized_params(hp, rng):
    """Init, then give every parameter random non-trivial values so every path of the model matters."""
    params = tg.init_params(hp, int(rng.integers(1 << 30)))
    out = {}
    for name, p in params.items():
        if name.endswith("lambdas") or name == "skip_weights":
            v = rng.uniform(0.3, 1.2, p.shape)
        elif name.endswith("c_proj.weight"):  # large enough that every block moves the residual stream
            v = rng.uniform(-1, 1, p.shape) * 2 * p.shape[1] ** -0.5
        elif name.endswith(("qkv_w", "c_fc.weight")):
            v = np.asarray(p, np.float64) * 3
        elif name == "lm_head.weight":
            v = rng.standard_normal(p.shape) * 0.3
        else:
            v = np.asarray(p, np.float64)
        out[name] = jnp.asarray(v, p.dtype)
    return out


def test_forward_matches_float64_reference():
    rng = np.random.default_rng()
    params = randomized_params(SMALL, rng)
    T, sw = SMALL.seq_len, int(rng.integers(2, 5))
    tokens = rng.integers(0, 50257, T + 1)
    tokens[rng.choice(T, 4, replace=False)] = 50256  # a few document starts
    p64 = {k: np.asarray(v, np.float64) for k, v in params.items()}

    x, y = jnp.asarray(tokens[:-1], jnp.int32), jnp.asarray(tokens[1:], jnp.int32)
    hidden, loss = jax.jit(lambda p: (tg.gpt_hidden(p, x, jnp.int32(sw)), tg.loss_fn(p, x, y, jnp.int32(sw), False)))(
        params)  # one program for both
    hidden = np.asarray(hidden, np.float64)
    ref = reference_hidden(p64, tokens[:-1], sw)
    err = np.linalg.norm(hidden - ref) / np.linalg.norm(ref)
    assert err < 0.03, err
    # the tolerance is tight enough to see a wiring mistake: popping the skips in the wrong order
    wrong = reference_hidden(p64, tokens[:-1], sw, skip_order="fifo")
    assert np.linalg.norm(wrong - ref) / np.linalg.norm(ref) > 3 * err

    logits = 30 / (1 + np.exp(-(ref @ p64["lm_head.weight"].T) / 7.5))
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    ref_loss = np.mean(lse - logits[np.arange(T), tokens[1:]])
    assert abs(float(loss) - ref_loss) < 0.01 * abs(ref_loss - LN_V) + 1e-3, (float(loss), ref_loss)


def test_rotary_leaves_half_the_dims_and_depends_on_relative_position():
    rng = np.random.default_rng()
    T = 4096
    cos, sin = tg.rotary_cos_sin(T)
    x = jnp.asarray(rng.standard_normal((T, 1, 128)), jnp.float32)
    y = np.asarray(tg.apply_rotary(x, cos, sin))
    unrotated = np.r_[32:64, 96:128]
    np.testing.assert_array_equal(y[..., unrotated], np.asarray(x)[..., unrotated])
    # the spec's formula in float64
    theta = np.arange(T)[:, None] * (1 / 1024) ** (np.arange(32) / 31)
    x1, x2 = np.asarray(x, np.float64)[:, 0, :32], np.asarray(x, np.float64)[:, 0, 64:96]
    np.testing.assert_allclose(y[:, 0, :32], x1 * np.cos(theta) + x2 * np.sin(theta), atol=2e-3)
    np.testing.assert_allclose(y[:, 0, 64:96], -x1 * np.sin(theta) + x2 * np.cos(theta), atol=2e-3)
    # <R(t)q, R(t+d)k> does not depend on t
    q = jnp.broadcast_to(jnp.asarray(rng.standard_normal(128), jnp.float32), (T, 1, 128))
    k = jnp.broadcast_to(jnp.asarray(rng.standard_normal(128), jnp.float32), (T, 1, 128))
    rq, rk = np.asarray(tg.apply_rotary(q, cos, sin))[:, 0], np.asarray(tg.apply_rotary(k, cos, sin))[:, 0]
    d = 37
    scores = np.sum(rq[: T - d] * rk[d:], -1)
    np.testing.assert_allclose(scores, scores[0], rtol=2e-3, atol=2e-3)


def random_weights(hp, seed):
    """Initial parameters with the zero-initialised matrices (projections, head) drawn like c_fc, so
    that every scalar parameter gets a non-zero gradient (at init most of them get exactly 0)."""
    rng = np.random.default_rng(seed)
    params = tg.init_params(hp, seed)
    for name, p in params.items():
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            bound = 3**0.5 * 0.5 * p.shape[-1] ** -0.5
            params[name] = jnp.asarray(rng.uniform(-bound, bound, p.shape), p.dtype)
    return params


def test_scalar_gradients_match_an_fp32_run():
    """bf16 gradients of the scalar parameters (lambdas, skip weights) vs the same model run in fp32.
    Their gradient is a sum over T x D products: as a bf16 reduction it was 7-21% off (median), and
    some changed sign. Weights and tokens are fixed: the worst case has a heavy tail over draws (5% to
    187% measured with fresh tokens; a late layer's cotangent rounding reaches every earlier block)."""
    hp = dataclasses.replace(tg.PRESETS["record"], num_layers=6, vocab_size=4096)  # width 768, 6 heads
    params = random_weights(hp, 0)
    rng = np.random.default_rng(100)
    tokens = rng.integers(0, hp.vocab_size, 1025)
    tokens[rng.random(1025) < 1 / 300] = tg.EOT
    x, y = jnp.asarray(tokens[:-1], jnp.int32), jnp.asarray(tokens[1:], jnp.int32)
    scalars = [k for k, p in params.items() if p.ndim == 1]
    errors, fp32_sizes = [], []
    # one program per dtype serves both windows (the window is a runtime value)
    bf16_grads = jax.jit(jax.grad(lambda p, w: tg.loss_fn(p, x, y, w, True, False, dtype=jnp.bfloat16)))
    fp32_grads = jax.jit(jax.grad(lambda p, w: tg.loss_fn(p, x, y, w, True, False, dtype=jnp.float32)))

    def scalar_grads(grad_fn, window):
        grads = grad_fn(params, jnp.int32(window))
        return np.concatenate([np.asarray(grads[k], np.float64) for k in scalars])

    for window in (1, 14):
        bf16 = scalar_grads(bf16_grads, window)
        with jax.default_matmul_precision("highest"):  # read when the call traces: part of the program's key
            fp32 = scalar_grads(fp32_grads, window)
        used = fp32 != 0  # attn.lambdas[1] of layers without value embeddings
        errors.append(np.abs(bf16 - fp32)[used] / np.abs(fp32[used]))
        fp32_sizes.append(np.abs(fp32[used]))
    errors, fp32_sizes = np.concatenate(errors), np.concatenate(fp32_sizes)
    big = fp32_sizes >= 0.25 * np.median(fp32_sizes)  # near-zero gradients have large relative errors anyway
    assert np.median(errors) < 0.05, np.median(errors)
    # This case measured median 0.9% (window 1) and 1.7% (14), worst 7.4% and 17.6%; with bf16-rounded
    # scalars (before the fix) 18.8% and 15.6%, worst 74% and 102%.
    assert errors[big].max() < 0.5, errors[big].max()


def test_mix_rounds_once_with_fp32_scalars():
    rng = np.random.default_rng()
    x, y = (jnp.asarray(rng.standard_normal((512, 512)), jnp.bfloat16) for _ in range(2))
    x32, y32 = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.array_equal(np.asarray(tg.mix((3.4445, x))), (np.float32(3.4445) * x32).astype(jnp.bfloat16))
    two = (np.float32(0.7) * x32 + np.float32(-1.3) * y32).astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(tg.mix((0.7, x), (-1.3, y))), two)
    s = jnp.float32(0.3)  # a 0-d fp32 parameter: bf16 forward, fp32 gradient
    grad_s = jax.grad(lambda s: jnp.sum(tg.mix((s, x)).astype(jnp.float32)))(s)
    assert tg.mix((s, x)).dtype == jnp.bfloat16 and grad_s.dtype == jnp.float32
    assert abs(float(grad_s) - np.sum(x32, dtype=np.float64)) < 1e-4 * np.abs(x32).sum()
