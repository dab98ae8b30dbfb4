"""§2 The model (train_gpt.py) against independent float64 oracles (brute-force loops and dense
masks), fresh random inputs; numbers read from the PyTorch reference (ref89.py) are named where used."""
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import train_gpt as m

BF16, F32 = jnp.bfloat16, jnp.float32
SMALL = dataclasses.replace(m.PRESETS["record"], head_dim=16, bigram_vocab_size=1000)


def bf16(x):
    return np.asarray(jnp.asarray(x, F32).astype(BF16).astype(F32), np.float64)


def dense_attention(q, k, v, docs, window, scale):
    """float64 oracle: softmax over keys j of the same document with 0 <= i - j <= window."""
    T, H, K = q.shape
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    ok = (i - j >= 0) & (i - j <= window) & (docs[:, None] == docs[None, :])
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    s = np.where(ok[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v)


@pytest.mark.parametrize("window", [0, 100, 128, 300])
def test_window_attention_matches_dense_attention_and_its_gradients(window):
    rng = np.random.default_rng(window)
    T, H, K = 512, 2, 16
    q, k, v = (bf16(rng.normal(size=(T, H, K))) for _ in range(3))
    docs = np.cumsum(rng.random(T) < 0.004).astype(np.int32)
    docs[200:] += 1  # at least one boundary
    scale = 0.3
    want = dense_attention(q, k, v, docs, window, scale)
    args = [jnp.asarray(x, BF16) for x in (q, k, v)]
    got = m.window_attention(*args, jnp.asarray(docs), jnp.int32(window), jnp.float32(scale))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2, rtol=2e-2)
    # gradients of <out, c> against the float64 oracle's finite differences would be slow: use autodiff
    # of a dense float32 JAX version of the oracle instead (independent of the block loop)
    c = rng.normal(size=(T, H, K))

    def dense_jax(q, k, v):
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        ok = (i - j >= 0) & (i - j <= window) & (docs[:, None] == docs[None, :])
        s = jnp.where(ok[None], jnp.einsum("ihd,jhd->hij", q, k) * scale, -jnp.inf)
        return jnp.sum(jnp.einsum("hij,jhd->ihd", jax.nn.softmax(s, -1), v) * c)

    want_g = jax.grad(dense_jax, argnums=(0, 1, 2))(*(jnp.asarray(x, F32) for x in (q, k, v)))
    got_g = jax.grad(lambda *a: jnp.sum(m.window_attention(*a, jnp.asarray(docs), jnp.int32(window),
                                                           jnp.float32(scale)).astype(F32) * c), argnums=(0, 1, 2))(*args)
    for g, w in zip(got_g, want_g):
        g, w = np.asarray(g, np.float64).ravel(), np.asarray(w, np.float64).ravel()
        if not w.any():  # window 0: each query sees only itself, so q and k get no gradient
            assert np.abs(g).max() < 1e-5
            continue
        assert g @ w / (np.linalg.norm(g) * np.linalg.norm(w)) > 0.999
        assert abs(np.linalg.norm(g) / np.linalg.norm(w) - 1) < 0.02


def test_a_static_diagonal_bound_gives_the_same_bits_and_nan_when_too_small():
    """max_diagonals (a train program's static loop count) runs diagonals past the window, masked out
    whole: output and gradients equal the runtime count's bit for bit, also with a bound past the
    sequence's 8 blocks; a bound below what the window needs gives NaN, never a shortened window. The
    loop is a scan (static trip count), not a while."""
    rng = np.random.default_rng()
    T, H, K = 1024, 2, 16
    q, k, v, c = (jnp.asarray(rng.normal(size=(T, H, K)), BF16) for _ in range(4))
    docs = jnp.asarray(np.cumsum(rng.random(T) < 0.003), jnp.int32)

    def run(window, bound):
        def loss(q, k, v):
            extra = () if bound is None else (bound,)
            out = m.window_attention(q, k, v, docs, jnp.int32(window), jnp.float32(0.25), *extra)
            return jnp.sum(out.astype(F32) * c.astype(F32)), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(x, F32) for x in (out, *grads)]

    # window 0: only the diagonal itself (1); 257-383 tokens: 4 diagonals
    for window, enough, short in ((0, (1, 12), 0), (int(rng.integers(2 * 128 + 1, 3 * 128)), (4, 7), 3)):
        want = run(window, None)
        for bound in enough:
            for got, w in zip(run(window, bound), want):
                np.testing.assert_array_equal(got, w, err_msg=f"window {window}, bound {bound}")
        assert all(np.isnan(x).all() for x in run(window, short)), (window, short)
    text = str(jax.make_jaxpr(lambda q: m.window_attention(q, k, v, docs, jnp.int32(300), jnp.float32(0.25), 7))(q))
    assert "scan[" in text and "while[" not in text
    assert "while[" in str(jax.make_jaxpr(lambda q: m.window_attention(q, k, v, docs, jnp.int32(300),
                                                                       jnp.float32(0.25)))(q))


def test_train_programs_bound_their_diagonals_by_their_stages_windows():
    """A program's bound covers the widest window of every stage of its shape (record: the last
    stage's program serves the extension too) and nothing wider; a shape of no stage has none."""
    hp = m.PRESETS["record"]
    shapes = {m.program_shape(s): [] for s in hp.stages}
    for s in hp.stages:
        shapes[m.program_shape(s)].append(s.windows)
    assert len(shapes) == 3 and len(shapes[m.program_shape(hp.stages[-1])]) == 2  # stages 2 and 3 share one
    for shape, windows in shapes.items():
        short, long = m.max_diagonals(hp, shape)
        for w_short, w_long in windows:  # window W blocks = W·128 tokens needs W + 1 diagonals
            assert short >= int(m._num_diagonals(w_short * m.BLOCK, 10**6))
            assert long >= int(m._num_diagonals(w_long * m.BLOCK, 10**6))
        assert (short, long) == (max(w for w, _ in windows) + 1, max(w for _, w in windows) + 1)
    assert m.max_diagonals(hp, (12345, 1)) is None


def test_dc_correction_matches_a_per_token_loop():
    rng = np.random.default_rng(1)
    T, H, K = 256, 6, 8
    q, k, v = (bf16(rng.normal(size=(T, H, K))) for _ in range(3))
    w1, w2 = bf16(rng.normal(size=(T, H))), bf16(rng.normal(size=(T, H)))
    docs = np.zeros(T, np.int32)
    docs[150:] = 1
    scale = 0.2
    want = np.zeros((T, H, K))
    for i in range(T):
        keys = [j for j in range(max(0, i - m.DC_WINDOW + 1), i + 1) if docs[j] == docs[i]]
        p = np.zeros((H, len(keys)))
        for g in range(H):
            s = np.array([q[i, g] @ k[j, g] for j in keys]) * scale
            p[g] = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        mixed = w1[i] @ p  # sum over heads g of w1_g p_g
        for h in range(H):
            want[i, h] = (w2[i, h] * mixed) @ v[keys, h]
    got = m.dc_correction(*(jnp.asarray(x, BF16) for x in (q, k, v)), jnp.asarray(docs),
                          jnp.asarray(w1, BF16), jnp.asarray(w2, BF16), jnp.float32(scale))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=3e-2 * np.abs(want).max())


def test_bigram_hash_is_the_references_wrapping_int32_hash():
    rng = np.random.default_rng(2)
    x = rng.integers(0, 50304, 300)
    buckets = 377280
    got = np.asarray(m.bigram_hash(jnp.asarray(x, jnp.int32), buckets))

    def wrap(v):  # two's-complement int32
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= 1 << 31 else v

    prev, want = buckets - 1, [buckets - 1]
    for t in range(1, len(x)):
        h = wrap(wrap(36313 * int(x[t])) ^ wrap(27191 * prev))
        want.append(h % (buckets - 1))  # Python's % floors, as torch's
        prev = int(x[t])
    assert got.tolist() == want


@pytest.mark.parametrize("paired", [False, True])
def test_rotary_uses_bf16_tables_of_fp32_angles_on_adjacent_lane_pairs(paired):
    rng = np.random.default_rng(3)
    T, H, K = 64, 6, 16
    x = bf16(rng.normal(size=(T, H, K)))
    freq = m.rope_freqs(K)
    pos = np.arange(T)
    got = np.asarray(m.rotary(jnp.asarray(x, BF16), jnp.asarray(freq), jnp.asarray(pos, F32), paired), np.float64)
    want = np.zeros_like(x)
    for t in range(T):
        for h in range(H):
            # paired: head 2p takes the angles of position 2t, head 2p+1 those of 2t+1
            angle_pos = (2 * t + h % 2) if paired else t
            theta = (np.float32(angle_pos) * freq).astype(np.float32)
            c, s = bf16(np.cos(theta)), bf16(np.sin(theta))
            for lane in range(0, K, 2):
                a, b = x[t, h, lane], x[t, h, lane + 1]
                want[t, h, lane] = c[lane] * a + s[lane] * b
                want[t, h, lane + 1] = c[lane + 1] * b - s[lane + 1] * a
    np.testing.assert_allclose(got, bf16(want), atol=1e-2)
    assert np.array_equal(got[..., K // 2:], x[..., K // 2:])  # the upper half does not rotate


def test_yarn_scales_the_softmax_as_the_reference_logs_it():
    hp = m.PRESETS["record"]
    # attn_scale printed by `ref89.py loss --stage 1` and `--stage 2` (record 89, seed 0): 0.116946, 0.127518
    assert m.yarn_state(423, hp)[1] == pytest.approx(0.116946, abs=1e-6)
    assert m.yarn_state(847, hp)[1] == pytest.approx(0.127518, abs=1e-6)
    assert m.yarn_state(0, hp)[1] == 0.1
    freq0, freq2 = m.yarn_state(0, hp)[0], m.yarn_state(847, hp)[0]
    assert (freq2 <= freq0).all() and freq2[0] == freq0[0]  # fast frequencies stay, slow ones are interpolated
    assert freq2[62] < freq0[62] * 0.3  # slowest frequency scaled by about 384/1408
    assert m.windows(1284, hp, final_val=True) == (768, 2560) and m.yarn_state(1285, hp)[1] == m.yarn_state(1270, hp)[1]


def test_fp8_logits_round_the_fp32_sums_once_and_lower_to_xlas_bf16_fp8_pattern_for_cuda(monkeypatch):
    """_fp8_logits: the fp32 sum of the e4m3 products times LM_HEAD_U_S, rounded once to bf16 (also where a
    reduction reads it in fp32); LM_HEAD_U_S the exact product of three bf16 values, 2.2e-6 below
    fp32(x_s)·fp32(w_s). Lowered for CUDA with cuBLAS's GEMMs: XLA's pattern for an FP8 GEMM with a bf16
    output (bf16 operands dequantized by two of them, the product times the third), which
    tests/test_gpu.py's FP8 check finds compiled as one cuBLASLt call writing bf16; with XLA's Triton
    GEMMs, the fp32 FP8 dot."""
    factors = m.LM_HEAD_U_FACTORS
    assert all(float(jnp.asarray(f, BF16)) == f for f in factors) and float(m.LM_HEAD_U_S) == math.prod(factors)
    fp32_product = float(np.float32(m.LM_HEAD_X_S) * np.float32(m.LM_HEAD_W_S))
    assert -2.2e-6 < float(m.LM_HEAD_U_S) / fp32_product - 1 < 0
    rng = np.random.default_rng()
    x_f8 = jnp.asarray(rng.normal(size=(64, 96)) * 8, F32).astype(m.E4M3)
    w_f8 = jnp.asarray(rng.normal(size=(96, 200)) * 8, F32).astype(m.E4M3)
    got = np.asarray(jax.jit(lambda x, w: m._fp8_logits(x, w).astype(F32) * 3)(x_f8, w_f8), np.float64) / 3
    assert np.array_equal(got, np.asarray(jnp.asarray(got, BF16), np.float64))  # on bf16's grid
    x64, w64, u_s = np.asarray(x_f8, np.float64), np.asarray(w_f8, np.float64), float(m.LM_HEAD_U_S)
    exact, magnitude = x64 @ w64 * u_s, np.abs(x64) @ np.abs(w64) * u_s
    half_step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 2.0**-60))) - 8)
    assert np.all(np.abs(got - exact) <= half_step + 96 * 2**-24 * magnitude)
    row_sums = np.asarray(jax.jit(lambda x, w: jnp.sum(m._fp8_logits(x, w).astype(F32), axis=1))(x_f8, w_f8))
    np.testing.assert_allclose(row_sums, got.sum(axis=1), rtol=1e-6, atol=1e-6)  # the rounded values' sums

    def dots(xla_flags):
        monkeypatch.setenv("XLA_FLAGS", xla_flags)
        fresh = jax.jit(lambda x, w: m._fp8_logits(x, w))  # traced anew: jit caches by function
        text = fresh.trace(x_f8, w_f8).lower(lowering_platforms=("cuda",)).as_text()
        return text, re.findall(r"stablehlo\.dot_general .*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\) -> "
                                r"tensor<[\dx]*x(\w+)>", text)

    text, found = dots("--xla_gpu_enable_triton_gemm=false")  # as train_gpt.backend_defaults sets it
    assert found == [("bf16", "bf16", "bf16")]
    constants = re.findall(r"stablehlo\.constant dense<([-+.\deE]+)> : tensor<bf16>", text)
    assert sorted(float(jnp.asarray(float(c), BF16)) for c in constants) == sorted(factors)
    assert dots("--xla_gpu_enable_triton_gemm=true")[1] == [("f8E4M3FN", "f8E4M3FN", "f32")]


@pytest.mark.parametrize("impl", m.GEMM_IMPLEMENTATIONS)  # pallas: the head's two passes after the same GEMM
def test_train_head_loss_matches_float64_on_the_same_fp8_logits(impl):
    rng = np.random.default_rng(4)
    T, D, V = 64, 32, 512
    x = bf16(rng.normal(size=(T, D)))
    w = bf16(rng.normal(size=(D, V)) * 0.05)
    targets = rng.integers(0, V, T)
    targets[1::4] = targets[0::4]  # an MTP target repeated: its column gets both weights
    prefix = np.where(rng.random(T) < 0.5, rng.integers(0, V, T), -1)
    prefix[::8] = targets[1::8]  # the prefix target equal to the next token
    mtp, pw = np.array([1.0, 0.5, 0.25], np.float32), np.float32(0.25)
    cols, ws, total = m._loss_targets(jnp.asarray(targets, jnp.int32), jnp.asarray(mtp), jnp.asarray(prefix, jnp.int32),
                                      jnp.float32(pw), V)
    loss_sum, losses = m.train_head_loss(jnp.asarray(x, BF16), jnp.asarray(w, BF16), cols, ws, total, impl)
    # oracle: the same e4m3 operands, then everything in float64
    x8 = np.asarray(jnp.asarray(x / m.LM_HEAD_X_S, F32).astype(m.E4M3).astype(F32), np.float64)
    w8 = np.asarray(jnp.asarray(w / m.LM_HEAD_W_S, F32).astype(m.E4M3).astype(F32), np.float64)
    u = bf16(x8 @ w8 * m.LM_HEAD_X_S * m.LM_HEAD_W_S)
    z = 23 * bf16(1 / (1 + np.exp(-(u + 5) / 7.5)))
    lse = np.log(np.exp(z).sum(1))
    want = np.zeros(T)
    for i in range(T):
        for k, wk in enumerate(mtp):
            if i + k < T:
                want[i] += wk * (lse[i] - z[i, targets[i + k]])
        if prefix[i] >= 0:
            want[i] += pw * (lse[i] - z[i, prefix[i]])
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-4, atol=1e-3)
    assert float(loss_sum) == pytest.approx(want.sum(), rel=1e-4)
    # gradient of the sum: compare with float64 autodiff-free formula through the same operands
    dx, dw = jax.grad(lambda a, b: m.train_head_loss(a, b, cols, ws, total, impl)[0], argnums=(0, 1))(
        jnp.asarray(x, BF16), jnp.asarray(w, BF16))
    p = np.exp(z - lse[:, None])
    grad_z = np.zeros((T, V))
    for i in range(T):
        grad_z[i] = (mtp.sum() + (pw if prefix[i] >= 0 else 0)) * p[i]
        for k, wk in enumerate(mtp):
            if i + k < T:
                grad_z[i, targets[i + k]] -= wk
        if prefix[i] >= 0:
            grad_z[i, prefix[i]] -= pw
    s = z / 23
    grad_u = grad_z * 23 / 7.5 * s * (1 - s)
    for got, want in [(dx, grad_u @ w8.T * m.LM_HEAD_W_S), (dw, x8.T @ grad_u * m.LM_HEAD_X_S)]:
        got, want = np.asarray(got, np.float64).ravel(), want.ravel()
        assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) > 0.995  # e5m2 keeps 2 mantissa bits
        assert abs(np.linalg.norm(got) / np.linalg.norm(want) - 1) < 0.05
    # the e5m2 gradient itself, element by element (the cosines above hide a few-% error per logit):
    # the oracle's rounded once to e5m2; only values at a rounding boundary may land one step apart
    g8 = m._train_head_fwd(jnp.asarray(x, BF16), jnp.asarray(w, BF16), cols, ws, total, impl)[1]
    g8 = np.asarray(g8.astype(F32), np.float64)
    want8 = np.asarray(jnp.asarray(grad_u / m.LM_HEAD_GRAD_S, F32).astype(m.E5M2).astype(F32), np.float64)
    assert (g8 == want8).mean() > 0.995
    # the target columns alone (XLA's head sets them after its pass over every logit), repeated ones included
    is_target = np.zeros((T, V), bool)
    for i in range(T):
        is_target[i, targets[i:i + len(mtp)]] = True
        if prefix[i] >= 0:
            is_target[i, prefix[i]] = True
    assert (g8 == want8)[is_target].mean() > 0.97


def test_the_softcaps_sigmoid_is_rounded_to_bf16_where_the_normaliser_sums_it():
    """_softcap_sig's bf16 rounding survives the normaliser's sum with the programs' COMPILER_OPTIONS and
    without them (XLA:CPU drops a bf16 round trip that a reduction reads: 3e-3 off in the log-sum-exp),
    and lowered for a GPU it is a convert (the hardware's), not reduce_precision's bit arithmetic."""
    u = jnp.asarray(np.random.default_rng().normal(0, 8, (32, 4096)), BF16)
    sig = bf16(1 / (1 + np.exp(-(np.asarray(u, np.float64) + m.SOFTCAP_B) / m.SOFTCAP_C)))
    want = np.log(np.exp(m.SOFTCAP_A * sig).sum(1))
    for options in (m.COMPILER_OPTIONS, None):
        got = jax.jit(lambda u: m._capped_lse(np.float32(m.SOFTCAP_A) * m._softcap_sig(u)), compiler_options=options)(u)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-7)
    text = jax.jit(m._softcap_sig).trace(u).lower(lowering_platforms=("cuda",)).as_text()
    assert re.search(r"stablehlo\.convert .*-> tensor<32x4096xbf16>", text) and "reduce_precision" not in text


def test_the_head_passes_match_the_xla_path_tile_by_tile():
    """pallas_head_softcap and pallas_head_grad (interpreted here) over 8 x 4 tiles of 8 x 128: each logit's
    rounded sigmoid, each row's normaliser from its column tiles' sums, and each gradient where the XLA
    path puts them. The kernels' exp is 2^(x·log2 e): on a GPU ex2.approx, so that a value next to a
    rounding midpoint may round the other way, rarely (the GPU lane bounds that); XLA:CPU computes it as
    exp itself."""
    rng = np.random.default_rng()
    T, V, P = 64, 512, 3  # P: no power of two
    tuning = m.PassTuning(rows=8, cols=128, num_warps=4)
    logits = jnp.asarray(rng.normal(0, 3, (T, V)), BF16)  # bf16, as _fp8_logits writes them
    sig, lse = m.pallas_head_softcap(logits, tuning)
    want_sig = m._softcap_sig(logits)
    got, want = np.asarray(sig, np.float64), np.asarray(want_sig, np.float64)
    assert sig.dtype == BF16 and np.mean(got != want) <= 1e-3
    assert np.all(np.abs(got - want) <= 2.0**-8)  # one bf16 step at most (sigmoids below 1)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(m._capped_lse(np.float32(m.SOFTCAP_A) * want_sig)),
                               rtol=1e-6)

    cols = rng.integers(0, V, (T, P))
    cols[::4, 1] = cols[::4, 0]  # a column twice in a row: both weights
    cols[1::4, 0] = rng.choice([0, 127, 128, 511], T // 4)  # at the tiles' edges
    cols = jnp.asarray(cols, jnp.int32)
    ws = jnp.asarray(rng.random((T, P)), F32)
    total = jnp.sum(ws, axis=1) + 0.25
    g = m.pallas_head_grad(sig, lse, total, cols, ws, tuning)
    column = jnp.arange(V, dtype=jnp.int32)
    targeted = m._targeted(column, [cols[:, k:k + 1] for k in range(P)], [ws[:, k:k + 1] for k in range(P)])
    want_g = m._logit_grads(m.f32(sig), lse, total, targeted)
    got, want = (np.asarray(a.astype(F32), np.float64) for a in (g, want_g))
    assert g.dtype == m.E5M2 and np.mean(got != want) <= 1e-3
    assert np.all(np.abs(got - want) <= 0.25 * np.abs(want) + 2.0**-16)  # one e5m2 step at most


def test_eval_head_loss_matches_float64_on_the_same_bf16_logits():
    """Validation's head: the softcap in fp32 on the bf16 logits, cross-entropy per token, the
    log-sum-exp shifted by A; across chunks (T = 3 x 128), logits from far below to near the cap."""
    rng = np.random.default_rng(5)
    T, D, V = 384, 32, 700
    x = jnp.asarray(rng.normal(size=(T, D)), BF16)
    w = jnp.asarray(rng.normal(size=(D, V)) * np.geomspace(0.01, 3, V), BF16)  # |u| from ~0.1 to ~50
    targets = rng.integers(0, V, T)
    got = np.asarray(m.eval_head_loss(x, w, jnp.asarray(targets, jnp.int32)), np.float64)
    u = np.asarray(jnp.matmul(x, w, preferred_element_type=F32).astype(BF16), np.float64)  # linear's bf16 output
    z = 23 / (1 + np.exp(-(u + 5) / 7.5))
    want = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) - z[np.arange(T), targets]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_matmul_stores_its_product_rounded_to_bf16_once():
    """matmul: bf16 operands, fp32 sums, the product rounded once to bf16 as its dot's own result type (on a
    GPU cuBLAS writes bf16, not an fp32 product that a pass rounds), and the rounding kept when a consumer
    in the same jit reads it in fp32 (jax 0.10.2's XLA:CPU handed such a consumer the fp32 product)."""
    rng = np.random.default_rng()
    a = jnp.asarray(rng.normal(size=(64, 96)), BF16)
    b = jnp.asarray(rng.normal(size=(96, 40)), BF16)
    got = np.asarray(jax.jit(lambda a, b: m.matmul(a, b).astype(F32) * 3)(a, b), np.float64) / 3
    assert np.array_equal(got, np.asarray(jnp.asarray(got, BF16), np.float64))  # on bf16's grid
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    exact, magnitude = a64 @ b64, np.abs(a64) @ np.abs(b64)
    assert np.all(np.abs(got - exact) <= 2**-8 * np.abs(exact) + 96 * 2**-24 * magnitude)  # half a bf16 step
    text = jax.jit(m.matmul).lower(a, b).as_text()
    assert re.findall(r"stablehlo\.dot_general .*-> tensor<[\dx]*x(\w+)>", text) == ["bf16"]


def test_linear_and_mlp_backward_run_bf16_gemms_with_autodiffs_values():
    """linear's backward gives what autodiff gives (its GEMMs on fp32 copies of the bf16 values) from
    bf16 GEMMs with fp32 accumulation, as torch's backward; the MLP's backward GEMMs are bf16 too, their
    products stored in bf16 (matmul)."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.normal(size=(2, 48, 32)), BF16)
    w = jnp.asarray(rng.normal(size=(16, 32)) * 0.1, BF16)
    r = jnp.asarray(rng.normal(size=(2, 48, 16)), F32)
    plain = lambda x, w: jnp.matmul(x, w.T, preferred_element_type=F32).astype(BF16)  # noqa: E731
    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(F32) * r)  # noqa: E731
    got, want = (jax.grad(loss(f), argnums=(0, 1))(x, w) for f in (m.linear, plain))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == BF16
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= 2**-7 * np.abs(b).max()  # one bf16 rounding of the same fp32 sums at most

    def gemm_operand_types(fn, *args):
        text = jax.jit(jax.grad(fn, argnums=tuple(range(len(args))))).lower(*args).as_text()
        return re.findall(r"stablehlo\.dot_general .*: \(tensor<[\dx]*x(\w+)>, tensor<[\dx]*x(\w+)>\) -> "
                          r"tensor<[\dx]*x(\w+)>", text)

    w1, w2 = (jnp.asarray(rng.normal(size=(64, 32)) * 0.1, BF16) for _ in range(2))
    mlp_loss = lambda x, w1, w2: jnp.sum(m.mlp_bf16(x, w1, w2).astype(F32))  # noqa: E731
    for types, backward in ((gemm_operand_types(loss(m.linear), x, w), 2), (gemm_operand_types(mlp_loss, x[0], w1, w2), 4)):
        assert len(types) >= backward and all(t == ("bf16", "bf16", "bf16") for t in types), types


def test_fp8_mlp_forward_and_bf16_backward():
    rng = np.random.default_rng(5)
    T, D, F = 128, 32, 128
    x = bf16(rng.normal(size=(T, D)))
    w1, w2 = bf16(rng.uniform(-0.1, 0.1, (F, D))), bf16(rng.uniform(-0.1, 0.1, (F, D)))
    pre = x @ w1.T
    want = np.maximum(pre, 0) ** 2 @ w2
    w2_scale = jnp.float32(np.abs(w2).max() * 1.12 / 448)
    act_scale = jnp.float32((np.maximum(pre, 0) ** 2).max() * 1.8 / 448)
    valid = jnp.ones(T, bool)
    (out, amax) = m.mlp_fp8(jnp.asarray(x, BF16), jnp.asarray(w1, BF16), jnp.asarray(w2, BF16), w2_scale, act_scale, valid)
    out = np.asarray(out, np.float64)
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 0.1  # three e4m3 operands
    assert float(amax) == pytest.approx((np.maximum(pre, 0) ** 2).max(), rel=0.02)
    bf = np.asarray(m.mlp_bf16(*(jnp.asarray(a, BF16) for a in (x, w1, w2))), np.float64)
    assert np.linalg.norm(bf - want) / np.linalg.norm(want) < 0.01
    # backward: relu'(pre)·2·relu(pre) through sqrt(post), in bf16, against float64
    g = rng.normal(size=(T, D))
    grads = jax.grad(lambda *a: jnp.sum(m.mlp_fp8(*a, w2_scale, act_scale, valid)[0].astype(F32) * g), argnums=(0, 1, 2))(
        *(jnp.asarray(a, BF16) for a in (x, w1, w2)))
    r = np.maximum(pre, 0)
    dpre = 2 * r * (g @ w2.T)
    wants = (dpre @ w1, dpre.T @ x, (r ** 2).T @ g)
    for got, want in zip(grads, wants):  # from the FP8 path's post-activation, as the reference saves it
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.1
    grads = jax.grad(lambda *a: jnp.sum(m.mlp_bf16(*a).astype(F32) * g), argnums=(0, 1, 2))(
        *(jnp.asarray(a, BF16) for a in (x, w1, w2)))
    for got, want in zip(grads, wants):
        got = np.asarray(got, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02


def test_pallas_mlp_kernels_give_the_xla_paths_values_and_float64s():
    """mlp_fp8's Pallas path (interpreted here): the up projection's post, its e4m3 copy and the max over
    valid rows, and the backward's dpre, against float64 on the same e4m3/bf16 operands (within their bf16
    roundings) and against the XLA path's (the same roundings: post bit for bit, its e4m3 sums being exact
    in fp32; dpre but where fp32 sums of bf16 products in another order round c the other way). Tiles cut
    to fit: 2 x 3 output tiles, K in 3 steps."""
    rng = np.random.default_rng(11)
    T, D, F = 256, 96, 384
    x = rng.normal(size=(T, D))
    valid = rng.random(T) < 0.8
    x[~valid] *= 50  # padding rows: huge, clipped into e4m3, left out of the max
    x, w1, w2 = (jnp.asarray(a, BF16) for a in (x, rng.uniform(-0.1, 0.1, (F, D)), rng.uniform(-0.1, 0.1, (F, D))))
    valid = jnp.asarray(valid)
    w2_scale, act_scale = jnp.float32(0.1 * 1.12 / 448), jnp.float32(0.02)

    w1_f8, w1_scale = m.quantize_up(w1)
    x_amax = float(jnp.max(jnp.where(valid[:, None], jnp.abs(x), 0)))
    x_f8 = jnp.clip(x.astype(F32) * (m.E4M3_MAX / x_amax), -m.E4M3_MAX, m.E4M3_MAX).astype(m.E4M3)
    dequant = np.float32(w1_scale) * np.float32(x_amax) / np.float32(m.E4M3_MAX)
    post, post_f8, amax = m.pallas_mlp_up(x_f8, w1_f8, dequant, act_scale, valid)
    pre64 = np.asarray(x_f8, np.float64) @ np.asarray(w1_f8, np.float64).T * float(dequant)
    post64 = np.maximum(bf16(pre64), 0) ** 2
    post = np.asarray(post, np.float64)
    # bf16 roundings: relu(pre) may round to the other neighbour than float64's (its fp32 sum differs), up
    # to 2^-7 of it (a bf16 ulp), which the square doubles, then post's own 2^-8; dpre below: c's other
    # neighbour and its own rounding
    assert np.all(np.abs(post - post64) <= 5 * 2.0**-8 * post64)
    want_f8 = jnp.minimum(jnp.asarray(post, F32) * (1 / act_scale), m.E4M3_MAX).astype(m.E4M3)  # as the XLA path
    assert np.array_equal(np.asarray(post_f8, np.float64), np.asarray(want_f8, np.float64))
    assert float(amax) == post[np.asarray(valid)].max() and post.max() > float(amax)  # padding left out
    xla_post = m._relu2(m.fp8_dot(x_f8, w1_f8, ((1,), (1,))) * dequant)  # _mlp_fp8_fwd's XLA path
    assert np.array_equal(post, np.asarray(xla_post, np.float64))

    g = jnp.asarray(rng.normal(size=(T, D)), BF16)
    dpre = np.asarray(m.pallas_mlp_dpre(g, w2, jnp.asarray(post, BF16)), np.float64)
    c64 = bf16(np.asarray(g, np.float64) @ np.asarray(w2, np.float64).T)
    dpre64 = 2 * c64 * np.sqrt(post)
    # (a floor of 2^-16 of the largest: an fp32 sum cancelling to near zero is off by more than its rounding)
    assert np.all(np.abs(dpre - dpre64) <= 3 * 2.0**-8 * np.abs(dpre64) + 2.0**-16 * np.abs(dpre64).max())
    c = jnp.matmul(g, w2.T, preferred_element_type=F32).astype(BF16)  # _mlp_bwd_bf16's XLA path
    xla_dpre = np.asarray((2 * c.astype(F32) * jnp.sqrt(jnp.asarray(post, F32))).astype(BF16), np.float64)
    differ = dpre != xla_dpre
    assert differ.mean() < 1e-3 and np.all(np.abs(dpre - xla_dpre)[differ] <= 2.0**-7 * np.abs(xla_dpre)[differ])

    # the whole MLP, forward and backward, through both paths
    def run(impl):
        def f(x, w1, w2):
            out, amax = m.mlp_fp8(x, w1, w2, w2_scale, act_scale, valid, impl)
            return jnp.sum(out.astype(F32) * g.astype(F32)), (out, amax)
        (_, aux), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, w1, w2)
        return [np.asarray(a, np.float64) for a in (*aux, *grads)]

    for name, a, b in zip(["out", "amax", "dx", "dw1", "dw2"], run("pallas"), run("xla")):
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b), name


def test_fp8_dots_in_triton_kernels_accumulate_as_triton_does_on_hopper():
    """Building a Pallas kernel gives the Triton dialect's dot builder, which Pallas's Triton lowering
    calls, Triton's own sm_90 default for FP8 operands (max_num_imprecise_acc 2**30: Hopper's FP8 wgmma,
    not mma.sync on fp16 copies); a bf16 dot, or one given a value, keeps what it was given."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith
    from jax._src.lib.triton import dialect as tt

    patched = tt.dot
    tt.dot = getattr(patched, "__wrapped__", patched)  # as JAX has it
    try:
        m._pallas(lambda o_ref: None, m.PALLAS_MLP_UP, "probe", out_shape=jax.ShapeDtypeStruct((8,), jnp.float32))
        assert tt.dot.fp8_imprecise_acc == 2**30
        once = tt.dot
        m._triton_fp8_dots_accumulate_as_on_hopper()
        assert tt.dot is once  # installed once, not wrapped twice

        ctx = ir.Context()
        tt.register_dialect(ctx)
        with ctx, ir.Location.unknown():
            module = ir.Module.create()
            with ir.InsertionPoint(module.body):
                def zeros(shape, element):
                    t = ir.RankedTensorType.get(shape, element)
                    return arith.constant(t, ir.DenseElementsAttr.get_splat(t, ir.FloatAttr.get(element, 0.0)))

                def imprecise_acc(a_type, b_type, **given):
                    op = tt.dot(zeros([64, 32], a_type), zeros([32, 64], b_type), zeros([64, 64], ir.F32Type.get()),
                                **given).owner
                    attr = op.attributes["maxNumImpreciseAcc"] if "maxNumImpreciseAcc" in op.attributes else None
                    return ir.IntegerAttr(attr).value if attr is not None else 0

                e4m3, e5m2, bf16 = ir.Float8E4M3FNType.get(), ir.Float8E5M2Type.get(), ir.BF16Type.get()
                assert imprecise_acc(e4m3, e4m3) == imprecise_acc(e5m2, e4m3) == 2**30
                assert imprecise_acc(bf16, bf16) == 0
                assert imprecise_acc(e4m3, e4m3, max_num_imprecise_acc=32) == 32
    finally:
        tt.dot = patched


def triton_module(kernel_call, *args) -> str:
    """The one Triton module that Pallas's Triton lowering builds for kernel_call(*args), lowered for an
    H100 on this machine (jax >= 0.11 asks for the GPU's kind: an abstract one, as no GPU is needed to
    lower)."""
    from jax._src.pallas.triton import lowering

    modules, lower = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = lower(*a, **k)
        modules.append(str(result.module))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Auto,),
                                                                      abstract_device=h100)):
            jax.jit(lambda *a: kernel_call(*a)).trace(*args).lower(lowering_platforms=("cuda",))  # (not cached)
    finally:
        lowering.lower_jaxpr_to_triton_module = lower
    [module] = modules
    return module


def triton_loop_body(kernel_call, *args) -> tuple:
    """(the K loop's iter_arg, its body's lines) of kernel_call(*args)'s Triton module."""
    module = triton_module(kernel_call, *args)
    loop = module[module.index("scf.for"):]
    carried = re.match(r"scf\.for .*?iter_args\((%\w+) = ", loop)[1]
    return carried, loop[:loop.index("scf.yield")].splitlines()[1:] + [loop[loop.index("scf.yield"):].splitlines()[0]]


def test_the_fp8_gemm_kernel_accumulates_into_its_loop_carried_sum():
    """mlp_up's K loop, as Triton gets it: its FP8 dot accumulates into the sum the loop carries, the
    reference kernel's tl.dot(a, b, acc), not a dot from zeros added to it after, which Triton's combine
    pass leaves unfolded for FP8 dots (each step's wgmma waited for, the sum kept twice); dpre's bf16 dot
    stays as JAX builds it, for Triton's own pass to fold."""
    S = jax.ShapeDtypeStruct
    carried, body = triton_loop_body(m.pallas_mlp_up, S((256, 256), m.E4M3), S((256, 256), m.E4M3), S((), F32),
                                     S((), F32), S((256,), jnp.bool_))
    yielded = re.search(r"scf\.yield (%\w+)", body[-1])[1]
    [accumulating] = [line for line in body if line.lstrip().startswith(f"{yielded} = tt.dot")]
    assert re.search(rf"tt\.dot %\w+, %\w+, {carried}[, ]", accumulating), accumulating
    assert "f8E4M3FN" in accumulating and not any("arith.addf" in line for line in body), body

    carried, body = triton_loop_body(m.pallas_mlp_dpre, S((256, 256), BF16), S((256, 256), BF16),
                                     S((256, 256), BF16))
    [dot] = [line for line in body if "tt.dot" in line]
    assert not re.search(rf"tt\.dot %\w+, %\w+, {carried}[, ]", dot) and any("arith.addf" in line for line in body)


def offset_types(module: str, pointee: str) -> set:
    """The offsets' element types of the Triton module's tt.addptr ops into arrays of `pointee`."""
    return set(re.findall(rf"tt\.addptr .*!tt\.ptr<{pointee}>>, tensor<[\dx]*x(i\d+)>", module))


@pytest.mark.parametrize("rows, offsets", [(2**16, "i32"), (2**16 + 64, "i64")])
def test_a_1_byte_array_past_2_31_elements_gets_64_bit_offsets_in_triton(rows, offsets):
    """Pallas's Triton lowering gives an array of at most 2**32 bytes i32 offsets, which wrap past 2**31
    elements: an int8 array of rows x 2**15 elements, 2**31 exactly (the last offset fits) or more."""
    def copy_kernel(x_ref, y_ref):
        y_ref[...] = x_ref[...]

    tile = m.PALLAS_HEAD_PASS
    spec = pl.BlockSpec((tile.rows, tile.cols), lambda i, j: (i, j))
    copy = m._pallas(copy_kernel, tile, "copy",
                     grid=(rows // tile.rows, 2**15 // tile.cols), in_specs=[spec], out_specs=spec,
                     out_shape=jax.ShapeDtypeStruct((rows, 2**15), jnp.int8))
    assert offset_types(triton_module(copy, jax.ShapeDtypeStruct((rows, 2**15), jnp.int8)), "i8") == {offsets}


def test_the_heads_e5m2_gradient_of_a_record_chunk_gets_64_bit_offsets():
    """head_grad's e5m2 gradient of the record's 49,152-row chunk: 2.47e9 elements in under 2**32 bytes,
    written with i32 offsets before (an illegal address on an H200, 2026-11-27)."""
    S, T, V, P = jax.ShapeDtypeStruct, 49152, 50304, 3
    module = triton_module(m.pallas_head_grad, S((T, V), BF16), S((T,), F32), S((T,), F32),
                           S((T, P), jnp.int32), S((T, P), F32))
    assert offset_types(module, "f8E5M2") == {"i64"} and offset_types(module, "bf16") == {"i64"}


def test_the_fp8_heads_backward_dots_ask_for_exact_accumulation_and_its_forward_for_fast():
    """The reference's head: forward use_fast_accum=True, backward False. XLA's cuBLASLt FP8 GEMM
    accumulates fast only at DEFAULT precision, so the backward's two FP8 dots are HIGHEST, the forward's
    DEFAULT (read from the gradient's jaxpr: the dots whose operands are e4m3/e5m2)."""
    from jax.extend import core as jax_core

    T, D, V = 16, 8, 32
    cols, ws, total = m._loss_targets(jnp.zeros(T, jnp.int32), jnp.ones(1, F32), jnp.full(T, -1, jnp.int32),
                                      jnp.float32(0), V)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: m.train_head_loss(x, w, cols, ws, total)[0], argnums=(0, 1)))(
        jnp.ones((T, D), BF16), jnp.ones((D, V), BF16))

    def fp8_dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general" and "float8" in str(eqn.invars[0].aval.dtype):
                yield eqn.params["precision"], {str(v.aval.dtype) for v in eqn.invars}
            for sub in jax_core.jaxprs_in_params(eqn.params):
                yield from fp8_dots(sub)

    highest = (jax.lax.Precision.HIGHEST,) * 2
    dots = list(fp8_dots(jaxpr.jaxpr))
    forward = [p for p, _ in dots if p != highest]  # the forward's logits: a dot in each platform's branch
    assert forward and set(forward) == {None}
    assert sorted(sorted(types) for p, types in dots if p == highest) == [
        ["float8_e4m3fn", "float8_e5m2"], ["float8_e4m3fn", "float8_e5m2"]]  # dx: g · w, dW: x · g


def test_bf16_rounded_rounds_as_a_bf16_cast_and_keeps_infinities_and_nans():
    import ml_dtypes
    rng = np.random.default_rng()
    x = (rng.standard_normal(100_000) * 10.0 ** rng.integers(-30, 30, 100_000)).astype(np.float32)
    ties = (rng.integers(0, 0x7F80, 1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)  # halfway, finite
    special = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 0.0, -0.0, 1e-45], np.float32)
    x = np.concatenate([x, ties, special])
    got = np.asarray(jax.jit(m._bf16_rounded)(x))
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)  # numpy's cast: to nearest, ties to even
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)  # (rounding up would carry)
    assert np.isnan(np.asarray(jax.jit(m._bf16_rounded)(nans))).all()


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_mlp_fp8_rounds_where_the_reference_does(impl):
    """mlp_fp8's forward and backward against float64 with the reference's roundings (ref89's README, the
    linear_relu_square shim): pre = bf16(acc), post = bf16(pre²), post_f8 = e4m3(min(post/act_scale, 448))
    from that bf16 post, up weights e4m3(bf16(w1/scale)) with scale = bf16(bf16 amax/448); backward
    dpre = bf16(2·bf16(g·W2ᵀ)·sqrt(post)). A compiler that keeps fp32 relu(pre)² for the e4m3 copy or
    sqrt(pre²) for sqrt(post) (XLA's excess precision; the port before 2026-11-27, CPU: out 2% off)
    fails. Only fp32-versus-float64 sums may round a value the other way."""
    rng = np.random.default_rng()
    T, D, F = 256, 128, 512
    x, w1, w2, g = (jnp.asarray(a, BF16) for a in (rng.normal(size=(T, D)), rng.uniform(-0.1, 0.1, (F, D)),
                                                    rng.uniform(-0.1, 0.1, (F, D)), rng.normal(size=(T, D))))
    valid = jnp.ones(T, bool)
    w2_scale, act_scale = np.float32(0.1 * 1.12 / 448), np.float32(0.05)

    def f(x, w1, w2):
        out, _ = m.mlp_fp8(x, w1, w2, w2_scale, act_scale, valid, impl)
        return jnp.sum(out.astype(F32) * g.astype(F32)), out
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(x, w1, w2)

    f64 = lambda a: np.asarray(jnp.asarray(a, F32), np.float64)  # noqa: E731
    e4m3 = lambda a: f64(jnp.asarray(np.asarray(a, np.float32)).astype(m.E4M3))  # noqa: E731
    X, W1, W2, G = (f64(a) for a in (x, w1, w2, g))
    w1_scale = bf16(np.float32(bf16(np.abs(W1).max())) / np.float32(448))
    w1_f8 = e4m3(bf16(np.float32(W1) / np.float32(w1_scale)))
    x_amax = np.float32(np.abs(X).max())
    x_f8 = e4m3(np.clip(np.float32(X) * (np.float32(448) / x_amax), -448, 448))
    pre = bf16(x_f8 @ w1_f8.T * float(np.float32(w1_scale) * x_amax / np.float32(448)))
    post = bf16(np.maximum(pre, 0) ** 2)
    post_f8 = e4m3(np.minimum(np.float32(post) * (np.float32(1) / act_scale), 448))
    w2_f8 = e4m3(np.clip(np.float32(W2) / w2_scale, -448, 448))
    want_out = bf16(post_f8 @ w2_f8 * float(act_scale * w2_scale))
    dpre = bf16(2 * bf16(G @ W2.T) * np.sqrt(post))
    wants = {"out": want_out, "dx": bf16(dpre @ W1), "dw1": bf16(dpre.T @ X), "dw2": bf16(post.T @ G)}
    for (name, want), got in zip(wants.items(), (out, *grads)):
        got = f64(got)
        rel = np.linalg.norm(got - want) / np.linalg.norm(want)
        # (a pre rounded the other way can flip post's e4m3 copy: 1 in 80 seeds gave out 1.2e-3 off, 0.35% of it)
        assert rel < 5e-3 and np.mean(got != want) < 0.02, (name, rel, np.mean(got != want))


def test_init_draws_the_references_distributions_and_zeros():
    p = m.init_params(SMALL, seed=0)
    D = SMALL.model_dim
    bound = 3**0.5 * 0.5 * D**-0.5
    for name, shape in m.param_shapes(SMALL).items():
        assert p[name].shape == shape[0] and p[name].dtype == shape[1], name
    qk, vo, mlp = (np.asarray(p[k], np.float64) for k in ("qk_bank", "vo_bank", "mlp_bank"))
    n_qk, n_vo = m.num_qk_matrices(), 2 * len(m.ATTN_LAYERS)
    assert n_qk == 60 and qk.shape[0] == 64 and not qk[n_qk:].any() and not vo[n_vo:].any()
    for real in (qk[:n_qk], vo[:n_vo], mlp[:, 0]):
        assert np.abs(real).max() <= bound and real.std() == pytest.approx(bound / 3**0.5, rel=0.02)
    assert not mlp[:, 1].any()  # c_proj starts at zero
    assert np.array_equal(np.asarray(p["embed.weight"]), np.asarray(p["lm_head.weight"]).T)
    assert float(np.asarray(p["lm_head.weight"], np.float64).std()) == pytest.approx(0.005, rel=0.02)
    assert float(np.asarray(p["value_embeds"], np.float64).std()) == pytest.approx(0.01, rel=0.02)
    for zero in ("smear_gate.weight", "bigram_embed.weight", "mudd_w2", "mudd_gate_w2", "ve_gate_bank"):
        assert not np.asarray(p[zero]).any(), zero
    w1 = np.asarray(p["mudd_w1"], np.float64)
    assert np.abs(w1).max() <= D**-0.5 and w1.std() == pytest.approx(D**-0.5 / 3**0.5, rel=0.05)
    # biases and scalars, as the reference's init_mudd / init_mudd_gate / init_misc set them (bf16 biases)
    b2, gb2 = np.asarray(p["mudd_b2"], np.float64), np.asarray(p["mudd_gate_b2"], np.float64)
    assert b2[0, 6] == 20 and b2[0, 8] == bf16(1.1**0.5 / 0.1) and b2[1, 1] == -5 and b2[0, 10] == 0
    assert (gb2[:, 12:18] == 2.5).all() and gb2[1, 28] == 5 and (gb2[1, 29:35] == 10).all()
    assert gb2[0, 19:26:2].tolist() == [0.5] * 4 and gb2[1, 19:28:2].tolist() == [0.5] * 5
    s = np.asarray(p["scalars"])
    assert s.shape == (24,) and s[:22].tolist() == [0.5, 1.0] * 11 and s[22] == 0 and s[23] == -1.5
    assert p["resid_lambdas"].dtype == np.float32 and (np.asarray(p["resid_lambdas"]) == np.float32(1.1**0.5)).all()
    signs = np.asarray(p["bigram_sign_table"], np.float64)
    assert set(np.unique(signs)) == {-1.0, 1.0} and abs(signs.mean()) < 0.05


def test_prefix_table_is_the_longest_proper_prefix_token():
    table = m.prefix_table(50304)
    import tiktoken.load
    ranks = tiktoken.load.load_tiktoken_bpe(m.gpt2_vocab())
    by_id = {t: b for b, t in ranks.items()}
    for t in range(50256):  # every token but <|endoftext|> (0.2 s)
        b = by_id[t]
        prefixes = [ranks[b[:n]] for n in range(1, len(b)) if b[:n] in ranks]
        assert table[t] == (prefixes[-1] if prefixes else -1)
    assert (table[50256:] == -1).all() and (table[:256] == -1).all()  # single bytes have no proper prefix
    # 'ĠThe' -> 'ĠTh'... checked by ids: the token for b" the" has prefix b" th"
    assert table[ranks[b" the"]] == ranks[b" th"]


@pytest.mark.heavy(3)
def test_the_whole_model_at_init_predicts_uniformly_and_gets_the_references_zero_gradients():
    hp = SMALL
    p = m.init_params(hp, seed=1)
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 50256, 257)
    toks[0] = toks[100] = m.BOS
    # (the validation path's uniform predictions at init: every tiny run's step-0 validation, checked in
    # test_records and test_distributed; its own program here would cost 12 s of CPU)
    train = np.asarray(m.loss_fn(p, toks, hp, 0, training=True))
    # per token: (1 + .5 + .25 + prefix .25 where the target has a prefix) x ln V, fewer MTP terms at the end
    prefixed = m.prefix_table(50304)[toks[1:201]] >= 0  # the prefix term counts where the target has one
    assert abs(train[:200].mean() / math.log(50304) - (1.75 + 0.25 * prefixed.mean())) < 0.02
    # a sequence that is not a multiple of 128 is padded after its end; what the padding holds changes
    # nothing (causal attention, no loss, left out of the FP8 amaxes): here it holds huge-norm tokens
    c_proj = jax.random.uniform(jax.random.PRNGKey(0), p["mlp_bank"][:, 1].shape, F32, -0.03, 0.03)
    pm = {**p, "mlp_bank": p["mlp_bank"].at[:, 1].set(c_proj.astype(BF16))}  # else the MLPs output 0 at init
    cut = np.asarray(m.loss_fn(pm, toks[:201], hp, 0, training=True))
    inputs, targets, T = m.padded_sequence(toks[:201], hp.bos_id)
    loud = 50300  # a padding row of the vocabulary, made one-hot: after the norm its one entry is sqrt(D)
    p2 = {**pm, "embed.weight": p["embed.weight"].at[loud].set(0).at[loud, 0].set(1)}
    inputs = inputs.at[T:].set(loud)
    again = m.training_pass(p2, inputs, targets, m.schedule_values(0, hp), 0, hp)[2]  # loss_fn's program
    assert cut.shape == (200,) and np.array_equal(np.asarray(again)[:T], cut)
    grads, _ = m.train_grads(p, toks, hp, 1)
    # zero at init, as measured on the reference (ref89 README, pitfall 7): their downstream weights are zero
    for name in ("mudd_w1", "mudd_gate_w1", "smear_gate.weight"):
        assert not np.asarray(grads[name]).any(), name
    assert not np.asarray(grads["mlp_bank"][:, 0]).any()
    assert np.asarray(grads["mlp_bank"][:11, 1]).any() and np.asarray(grads["qk_bank"][:60]).any()
    assert not np.asarray(grads["qk_bank"][60:]).any() and not np.asarray(grads["mlp_bank"][11]).any()

    # with every bank random (none zero as at init), each matrix the model uses gets a gradient, finite and
    # non-zero: a forward op without a derivative (bit operations, a stop_gradient) on a path zeroes some
    # (2026-11-27: a bf16 rounding on the bits at the DC correction's output zeroed layer 10's). The same
    # shapes as above: train_grads' program compiles once
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 3))
    for name in ("qk_bank", "vo_bank", "mlp_bank"):
        p[name] = (0.02 * jax.random.normal(next(keys), p[name].shape, F32)).astype(p[name].dtype)
    grads, loss = m.train_grads(p, toks, hp, 1)
    assert np.isfinite(float(loss))
    used = {"qk_bank": m.num_qk_matrices(), "vo_bank": 2 * len(m.ATTN_LAYERS), "mlp_bank": m.NUM_LAYERS}
    for name, n in used.items():
        g = np.asarray(grads[name][:n], np.float32).reshape(n, -1, *grads[name].shape[-2:])
        assert np.isfinite(g).all(), name
        norms = np.sqrt((g.astype(np.float64) ** 2).sum(axis=(-2, -1)))
        assert (norms > 0).all(), (name, np.argwhere(norms == 0).tolist())


def test_fp8_buffers_are_written_as_the_references_quantize_leaves_them():
    """After a step the reference's quantize_mlp_fp8 leaves: the scales the next forward uses (measured in
    bf16 during the bootstrap, else the previous weights' amax x 1.12/448) and the next ones, from the
    current weights (what ref89's npz and --save-weights hold)."""
    rng = np.random.default_rng(8)
    bank = jnp.asarray(rng.uniform(-0.05, 0.05, (12, 2, 16, 8)), BF16).at[11].set(0)  # a zero padding layer
    previous = rng.uniform(1e-4, 2e-4, 12).astype(np.float32)
    fp8 = {"next_w": jnp.asarray(previous)}
    act = jnp.full(12, 0.5, F32)
    amax = np.abs(np.asarray(bank[:, 1], np.float64)).max(axis=(1, 2))
    for next_step, bootstrap in [(SMALL.fp8_bootstrap_steps, True), (SMALL.fp8_bootstrap_steps + 1, False)]:
        out = {k: np.asarray(v, np.float64) for k, v in
               m.reference_fp8_buffers({"mlp_bank": bank}, fp8, act, next_step, SMALL).items()}
        np.testing.assert_allclose(out["_mlp_down_proj_next_scales"], np.maximum(amax, 1e-12) * 1.12 / 448, rtol=1e-6)
        measured = bf16(bf16(np.maximum(amax, 1e-12)) / 448)
        np.testing.assert_array_equal(out["_mlp_down_proj_scales"], measured if bootstrap else previous)
        assert np.array_equal(out["_mlp_down_act_scales"], np.asarray(act))


def test_gradients_stack_the_banks_and_scatter_embedding_rows_as_the_reference():
    """Each bank's gradient is one stack of its matrices' gradients (slicing a bank layer by layer gave
    the same values as a sum of one zero-padded copy per layer: 40% of a CPU smoke step, measured);
    the embed and bigram tables' gradients are scatter-adds in fp32, the value embeddings' in bf16."""
    hp = SMALL
    p = m.init_params(hp, seed=1)
    toks = np.random.default_rng(3).integers(0, 50256, 129)
    inputs, targets, _ = m.padded_sequence(toks, hp.bos_id)
    train = m.trainable(p, hp)
    text = m._jit_grads.lower(train, {k: v for k, v in p.items() if k not in train}, inputs, targets,
                              m.schedule_values(1, hp), *m.training_inputs(p, targets, 1, hp)).as_text()
    padded = re.findall(r"stablehlo\.pad .*-> tensor<([\dx]+)x\w+>", text)
    banks = {"x".join(map(str, p[k].shape)) for k in ("qk_bank", "vo_bank", "mlp_bank")}
    assert not banks & set(padded), sorted(set(padded))
    scatters = re.findall(r'"stablehlo\.scatter".*?\}\) : \(tensor<([\dx]+)x(\w+)>', text, re.S)
    shape = lambda *s: "x".join(map(str, s))  # noqa: E731
    tables = {shape(*p["embed.weight"].shape): "f32", shape(*p["bigram_embed.weight"].shape): "f32",
              shape(len(m.VE_LAYERS), *p["embed.weight"].shape): "bf16"}  # value embeddings: the reference's bf16 atomics
    assert {(s, t) for s, t in scatters if s in tables} == set(tables.items()), scatters


def test_embedding_gradient_sums_repeated_rows_in_fp32_and_rounds_once():
    """torch's nn.Embedding backward sums a row's cotangents in fp32 and rounds once; a bf16
    scatter-add loses most of a frequent token's sum (4,096 terms near 1 give about 1,000)."""
    rng = np.random.default_rng(6)
    V, D, T = 50, 8, 6000
    table = jnp.asarray(rng.normal(size=(V, D)), BF16)
    ids = np.where(rng.random(T) < 0.7, 3, rng.integers(0, V, T))  # token 3 about 4,200 times
    g = bf16(rng.normal(1.0, 1.0, size=(T, D)))
    assert np.array_equal(np.asarray(m.embedding(table, jnp.asarray(ids)), np.float64), bf16(table)[ids])
    got = jax.grad(lambda t: jnp.sum(m.embedding(t, jnp.asarray(ids)).astype(F32) * jnp.asarray(g, F32)))(table)
    assert got.dtype == BF16
    want = np.zeros((V, D))
    np.add.at(want, ids, g)  # float64 sums of every row's cotangents
    got = np.asarray(got, np.float64)
    assert np.all(np.abs(got - want) <= 2**-8 * np.abs(want))  # one bf16 rounding of the fp32 sums
    assert np.abs(want[3]).min() > 3000  # the frequent row is there, and large
