"""§2 The fused attention (train_gpt.py, Pallas) against window_attention (the pure-JAX
path it replaces) and a dense float64 oracle of the rule, in Pallas interpret mode; its block tables
against a brute-force search; and its lowering to Triton for CUDA at the record's shapes without a GPU.
Compiling an interpret-mode kernel takes seconds: each test shares one program over its runtime cases."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_gpt as m

BF16, F32 = jnp.bfloat16, jnp.float32
K = 32  # head dim: the record's is 128; a smaller one keeps interpret mode fast
# self only, not a block multiple, one and three blocks, wider than T; and 254, whose run of keys every query
# of a block sees starts one past a tile's start and whose run of queries that see every key of a block ends
# one past a tile's end: a kernel that took the tile at either edge for full (unmasked) gets other values
WINDOWS = (0, 100, 128, 254, 3 * 128, 5000)


def dense_oracle_f64(q, k, v, docs, window, scale, dout):
    """float64: out, lse (H x T, natural log) and the gradients of sum(out·dout), with the rule written
    out as a T x T mask: key j of query i iff 0 <= i - j <= window and docs[i] == docs[j]."""
    q, k, v, dout = (np.asarray(x, np.float64).transpose(1, 0, 2) for x in (q, k, v, dout))  # H x T x K
    i = np.arange(q.shape[1])
    distance = i[:, None] - i[None, :]
    allowed = (distance >= 0) & (distance <= window) & (docs[:, None] == docs[None, :])
    s = np.where(allowed[None], q @ k.transpose(0, 2, 1) * scale, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.exp(s - mx)
    prob = e / e.sum(-1, keepdims=True)
    out = prob @ v
    lse = (mx + np.log(e.sum(-1, keepdims=True)))[..., 0]
    ds = prob * (dout @ v.transpose(0, 2, 1) - np.sum(dout * out, -1, keepdims=True)) * scale
    dq, dk, dv = ds @ k, ds.transpose(0, 2, 1) @ q, prob.transpose(0, 2, 1) @ dout
    return (out.transpose(1, 0, 2), lse, *(g.transpose(1, 0, 2) for g in (dq, dk, dv)))


def random_docs(rng, T, mean_length, first_length=0):
    """Nondecreasing ids (cumsum of BOS) with boundaries anywhere, most inside blocks; none in the first
    first_length tokens."""
    starts = rng.random(T) < 1 / mean_length
    starts[:first_length] = False
    return np.cumsum(starts).astype(np.int32)


def random_inputs(rng, T, H, dtype):
    # q x 3: logits of several units exercise the online softmax's rescaling
    return tuple(jnp.asarray(rng.standard_normal((T, H, K)) * s, dtype) for s in (3, 1, 1, 1))


def everything(attention):
    """jit of (q, k, v, docs, window, scale, dout) -> (out, dq, dk, dv, dscale) through the custom_vjp."""
    def run(q, k, v, docs, window, scale, dout):
        out, vjp = jax.vjp(lambda q, k, v, scale: attention(q, k, v, docs, window, scale), q, k, v, scale)
        return out, *vjp(dout)
    return jax.jit(run)


PALLAS, XLA = everything(m.pallas_window_attention), everything(m.window_attention)


def abs_err(a, b):
    return np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))


def max_err(a, b):
    return float(np.max(abs_err(a, b)))


@pytest.mark.parametrize("T, H", [(512, 6), (1024, 3)])  # a layer's heads; a paired layer's doubled sequence
def test_matches_window_attention_and_float64_oracle(T, H):
    rng = np.random.default_rng()
    q, k, v, dout = random_inputs(rng, T, H, BF16)
    # a layer's 512 tokens: a document longer than 3 blocks (the windows bind), then short ones
    # (boundaries inside blocks); a paired layer repeats each token's id
    docs = np.repeat(random_docs(rng, 512, 40, first_length=int(rng.integers(400, 450))), T // 512)
    scale = np.float32(rng.uniform(0.15, 0.3))
    programs = PALLAS._cache_size()
    for window in WINDOWS:
        args = (q, k, v, jnp.asarray(docs), jnp.int32(window), jnp.float32(scale), dout)
        ours, xla = PALLAS(*args), XLA(*args)
        ref = dense_oracle_f64(q, k, v, docs, window, float(scale), dout)
        assert ours[0].dtype == BF16 and ours[0].shape == q.shape
        assert all(g.dtype == BF16 and g.shape == q.shape for g in ours[1:4])
        assert ours[4].dtype == F32 and float(ours[4]) == 0.0  # the scale gets a zero cotangent
        for name, o, x, r in zip(("out", "dq", "dk", "dv"), ours, xla, ref[:1] + ref[2:]):
            size, err_o, err_x = np.max(np.abs(r)), abs_err(o, r), abs_err(x, r)
            # both round to bf16 at the same points (p before p·v, ds, the results): the pure-JAX
            # path's error is the yardstick. Their fp32 sums differ in order, so an intermediate next to
            # a bf16 midpoint can round the other way and move a result by up to ~1 ulp of the largest
            # (CI, 2026-11-28: dq 1.3 units of 2^-8·size from the oracle where the XLA path's was 0.7).
            # So the largest error may exceed the yardstick's by one unit, and the mean error, which a
            # rare flip cannot move, catches a systematic loss of precision (honest runs: at most 0.16
            # units and 0.16% over, in 4,060 cases of 203 draws; with p rounded before ds, lse off by
            # 1e-3 or l summed from rounded p: means 1-10% over)
            assert err_o.max() <= err_x.max() + 2**-8 * size, (name, window, err_o.max(), err_x.max())
            assert err_o.mean() <= 1.01 * err_x.mean(), (name, window, err_o.mean(), err_x.mean())
            assert max_err(o, x) <= 2**-6 * size, (name, window, max_err(o, x))
        if window == 0:  # every query sees only itself
            np.testing.assert_array_equal(np.asarray(ours[0], F32), np.asarray(v, F32))
    assert PALLAS._cache_size() == programs + 1  # one program for every window and scale


def test_fp32_with_other_tiles_matches_float64_oracle():
    """fp32 inputs isolate the kernels' logic from bf16 rounding; tiles smaller than a block put the token
    window's edge and document starts inside tiles; unsorted document ids take the window-only tables."""
    rng = np.random.default_rng()
    T, H = 512, 3
    q, k, v, dout = random_inputs(rng, T, H, F32)
    fwd = partial(m._pallas_forward, tuning=m.KernelTuning(tile=32, num_warps=4, num_stages=2))
    bwd = partial(m._pallas_backward, dq_tuning=m.KernelTuning(tile=16, num_warps=4, num_stages=2),
                  dkv_tuning=m.KernelTuning(tile=128, num_warps=8, num_stages=2))

    @jax.jit
    def run(q, k, v, docs, window, scale, dout):
        out, lse = fwd(q, k, v, docs, window, scale)
        return out, lse, *bwd(q, k, v, docs, window, scale, out, lse, dout)

    cases = [(random_docs(rng, T, 30), 37), (random_docs(rng, T, 200), 200), (random_docs(rng, T, 1000), 300),
             (rng.integers(0, 3, T).astype(np.int32), 150)]
    for docs, window in cases:
        scale = float(rng.uniform(0.15, 0.3))
        ours = run(q, k, v, jnp.asarray(docs), jnp.int32(window), jnp.float32(scale), dout)
        ref = dense_oracle_f64(q, k, v, docs, window, scale, dout)
        for name, o, r in zip(("out", "lse", "dq", "dk", "dv"), ours, ref):
            assert o.dtype == F32
            assert max_err(o, r) < 1e-5 * np.max(np.abs(r)), (name, window, max_err(o, r))


def test_the_kernels_take_the_tiles_the_tables_call_full_unmasked(monkeypatch):
    """A tile the block tables call full goes through _masked's first branch, which applies no mask: with
    that branch poisoned (its scores shifted) each kernel's result moves on one long document, and none
    moves at window 0, where every tile needs its mask (each query sees only itself)."""
    x = jnp.arange(6.0).reshape(2, 3)
    nothing_visible = lambda: jnp.zeros((2, 3), bool)  # noqa: E731
    np.testing.assert_array_equal(m._masked(jnp.bool_(True), -9.0, x, nothing_visible), x)  # not applied
    np.testing.assert_array_equal(m._masked(jnp.bool_(False), -9.0, x, nothing_visible), jnp.full((2, 3), -9.0))
    rng = np.random.default_rng()
    T, H = 512, 2
    q, k, v, dout = random_inputs(rng, T, H, F32)
    docs = jnp.zeros(T, jnp.int32)

    def run(window):
        out, lse = m._pallas_forward(q, k, v, docs, window, 0.2)
        return (out, *m._pallas_backward(q, k, v, docs, window, 0.2, out, lse, dout))

    honest = {w: run(w) for w in (0, 384)}
    monkeypatch.setattr(m, "_masked", lambda full, value, x, visible: jax.lax.cond(  # + 1 on a full tile's scores
        full, lambda x: x + 1, lambda x: jnp.where(visible(), x, value), x))  # (forward) or probabilities
    poisoned = {w: run(w) for w in (0, 384)}
    for name, h, p in zip(("out", "dq", "dk", "dv"), honest[384], poisoned[384]):
        assert max_err(h, p) > 1e-3, name  # every kernel took full tiles
    for name, h, p in zip(("out", "dq", "dk", "dv"), honest[0], poisoned[0]):
        np.testing.assert_array_equal(np.asarray(h), np.asarray(p), err_msg=name)


def test_block_tables_visit_exactly_the_block_pairs_with_a_visible_key_and_mask_only_where_needed():
    rng = np.random.default_rng()
    N = 16
    T = 128 * N
    tables = jax.jit(m._block_tables)
    n, j = np.arange(N)[:, None], np.arange(N)[None, :]
    i = np.arange(T)
    distance = i[:, None] - i[None, :]
    layouts = {"short docs": random_docs(rng, T, 40), "long docs": random_docs(rng, T, 600),
               "one doc": np.zeros(T, np.int32), "doc per block": (i // 128).astype(np.int32),
               "paired": np.repeat(random_docs(rng, T // 2, 100), 2),
               "unsorted": rng.integers(0, 4, T).astype(np.int32)}
    full_tiles = 0
    for kind, docs in layouts.items():
        for window in (0, 1, 127, 128, 129, 3 * 128, 1000, T):
            lo_N, hi_N, full_from_N, full_to_N = (np.asarray(t) for t in tables(jnp.asarray(docs), jnp.int32(window)))
            allowed = (distance >= 0) & (distance <= window) & (docs[:, None] == docs[None, :])
            pairs_NxN = allowed.reshape(N, 128, N, 128).any(axis=(1, 3))  # [n, j]: query block n, key block j
            fwd_NxN, dkv_NxN = (lo_N[:, None] <= j) & (j <= n), (j <= n) & (n <= hi_N[None, :])
            np.testing.assert_array_equal(fwd_NxN, dkv_NxN, err_msg=kind)  # the three kernels visit the same pairs
            if kind == "unsorted":  # the window alone bounds the loops
                np.testing.assert_array_equal(fwd_NxN, (j <= n) & (n - j <= -(-window // 128)))
            else:
                np.testing.assert_array_equal(fwd_NxN, pairs_NxN, err_msg=f"{kind}, window {window}")
            # the tiles left unmasked: the keys every query of block n sees, in a run up to the block, and the
            # queries that see every key of block j, in a run from its end; none where docs are unsorted
            begin, end = np.arange(N) * 128, np.arange(N) * 128 + 128
            keys_seen = [allowed[b:e].all(axis=0) for b, e in zip(begin, end)]
            queries_seeing = [allowed[:, b:e].all(axis=1) for b, e in zip(begin, end)]
            if kind == "unsorted":
                np.testing.assert_array_equal(full_from_N, begin)
                np.testing.assert_array_equal(full_to_N, end)
                continue
            run_back = [b - next((b - 1 - t for t in range(b - 1, -1, -1) if not seen[t]), b) for b, seen in
                        zip(begin, keys_seen)]
            run_on = [e + next((t - e for t in range(e, T) if not seeing[t]), T - e) for e, seeing in
                      zip(end, queries_seeing)]
            np.testing.assert_array_equal(full_from_N, run_back, err_msg=f"{kind}, window {window}")
            np.testing.assert_array_equal(full_to_N, run_on, err_msg=f"{kind}, window {window}")
            full_tiles += np.sum(begin - full_from_N) + np.sum(full_to_N - end)
    assert full_tiles > 0  # not a test of empty ranges only


@pytest.mark.parametrize("T, H", [(49152, 6), (98304, 3)])  # the record's longest stage; its paired layers
def test_kernels_lower_to_triton_for_cuda_at_the_record_shapes(T, H):
    """Lowers forward and backward for CUDA without a GPU and without running anything. jax >= 0.11 needs
    an abstract GPU for it; 0.10 accepts one too."""
    x = jax.ShapeDtypeStruct((T, H, 128), BF16)
    docs = jax.ShapeDtypeStruct((T,), jnp.int32)
    window, scale = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), F32)
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")

    def loss(q, k, v, docs, window, scale):
        return jnp.sum(m.pallas_window_attention(q, k, v, docs, window, scale).astype(F32))

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x, docs, window, scale).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("@__gpu$xla.gpu.triton(") == 3  # the fwd, dq and dk/dv kernels as Triton custom calls
    for name, tuning in (("fwd", m.PALLAS_FWD), ("dq", m.PALLAS_DQ), ("dkv", m.PALLAS_DKV)):
        assert (f'name = "attention_{name}", num_stages = {tuning.num_stages} : i32, '
                f"num_warps = {tuning.num_warps} : i32") in text
    assert text.count(f"grid_x = {T // 128} : i32, grid_y = {H} : i32") == 3
    assert "stablehlo.while" not in text  # no interpret-mode kernel slipped in


# --- the DC correction's kernels (layer 10; --dc pallas) ---------------------------------------------


def bf16_f64(x):
    """x rounded to bf16 (to nearest even), as float64."""
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def dc_oracle_f64(y, q, k, v, docs, w1, w2, scale, dout):
    """float64, dense, with the reference's DC kernels' roundings: out = bf16(y + Σ_j c_h·v_h) with
    c_h = bf16(w2_h·Σ_g w1_g·p_g) (passing its gradient unrounded); the backward's dc_h = dout_h·v_h
    unrounded and ds_g rounded to bf16 before its products; the gradients of sum(out·dout) in bf16. The
    rule as a T x T mask: key j of query i iff 0 <= i - j < DC_WINDOW and docs[i] == docs[j]."""
    y, q, k, v, w1, w2, dout = (np.asarray(jnp.asarray(x, F32), np.float64) for x in (y, q, k, v, w1, w2, dout))
    i = np.arange(q.shape[0])
    distance = i[:, None] - i[None, :]
    allowed = (distance >= 0) & (distance < m.DC_WINDOW) & (docs[:, None] == docs[None, :])
    s = np.where(allowed, np.einsum("ihd,jhd->hij", q, k) * scale, -np.inf)  # H x T x T
    e = np.exp(s - s.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    a = np.einsum("ig,gij->ij", w1, p)
    c = bf16_f64(w2.T[:, :, None] * a[None])
    out = y + np.einsum("hij,jhd->ihd", c, v)
    dc = np.einsum("ihd,jhd->hij", dout, v)
    da = np.einsum("ih,hij->ij", w2, dc)
    dp = w1.T[:, :, None] * da[None]
    ds = bf16_f64(p * (dp - np.sum(p * dp, -1, keepdims=True)))
    grads = (dout, np.einsum("hij,jhd->ihd", ds, k) * scale, np.einsum("hij,ihd->jhd", ds, q) * scale,
             np.einsum("hij,ihd->jhd", c, dout), np.einsum("gij,ij->ig", p, da), np.einsum("hij,ij->ih", dc, a))
    return [bf16_f64(x) for x in (out, *grads)]


def dc_everything(add_correction):
    """jit of (y, q, k, v, docs, w1, w2, scale, dout) -> (out, dy, dq, dk, dv, dw1, dw2, dscale)."""
    def run(y, q, k, v, docs, w1, w2, scale, dout):
        out, vjp = jax.vjp(lambda y, q, k, v, w1, w2, scale: add_correction(y, q, k, v, docs, w1, w2, scale),
                           y, q, k, v, w1, w2, scale)
        return out, *vjp(dout)
    return jax.jit(run)


def test_dc_kernels_and_the_xla_path_round_as_the_reference():
    """pallas_add_dc_correction and add_dc_correction (the XLA path, its backward written out) against
    float64 with the reference kernels' roundings, in units of 2^-8 of a value (floored at 2^-12 of the
    largest): 40 seeds gave at most 3.0 units (both paths) and 0.04% of the values beyond one. A c_h or ds
    next to a bf16 midpoint may round the other way: in a dq that mostly cancels (the floor's unit) one
    flipped term ds·k·scale moves it by up to 16·|ds·k·scale|/max|dq| units; 3,440 seeds (2026-11-28) gave
    at most 7.2 (the XLA path's dq, documents of 400), 13 seeds beyond 4, 3 beyond 5, so the bound is 16
    units (8 would fail about 1 run in 5,000). The XLA path's autodiff, which rounded dc_h to bf16 and kept
    ds in fp32, was 10.5 units away, 15% of dw1 beyond one.
    384 tokens: the first 7 programs' keys start at 0, the dk/dv kernel's last 7 take the last 128 queries.
    Documents of mean length 60 (boundaries bind) and 400 (the 112-token window binds); q x 3: peaked rows,
    where one key too many or too few moves a value by much of itself (such mutants: 22-60,000 units)."""
    rng = np.random.default_rng()
    T, H = 384, 6
    q, k, v, y = (jnp.asarray(rng.standard_normal((T, H, K)) * s, BF16) for s in (3, 1, 1, 1))
    w1, w2 = (jnp.asarray(rng.standard_normal((T, H)), BF16) for _ in range(2))
    dout = jnp.asarray(rng.standard_normal((T, H, K)), BF16)
    scale = np.float32(rng.uniform(0.1, 0.2))
    units = lambda got, want: np.abs(got - want) / (2.0**-8 * np.abs(want) + 2.0**-12 * np.abs(want).max())  # noqa: E731
    pallas, xla = dc_everything(m.pallas_add_dc_correction), dc_everything(m.add_dc_correction)
    for mean_length in (60, 400):
        docs = random_docs(rng, T, mean_length)
        args = (y, q, k, v, jnp.asarray(docs), w1, w2, jnp.float32(scale), dout)
        ours, theirs = pallas(*args), xla(*args)
        want = dc_oracle_f64(y, q, k, v, docs, w1, w2, scale, dout)
        assert float(ours[-1]) == float(theirs[-1]) == 0.0  # the scale gets a zero cotangent
        for dy in (ours[1], theirs[1]):  # y's: dout itself
            np.testing.assert_array_equal(np.asarray(dy, F32), np.asarray(dout, F32))
        for name, o, x, r, like in zip(("out", "dy", "dq", "dk", "dv", "dw1", "dw2"), ours, theirs, want,
                                       (y, y, q, k, v, w1, w2)):
            assert o.dtype == like.dtype and o.shape == like.shape, name
            assert x.dtype == like.dtype and x.shape == like.shape, name
            for path, got in (("pallas", o), ("xla", x)):
                u = units(np.asarray(got, np.float64), r)
                assert u.max() <= 16 and np.mean(u > 1) <= 2e-3, (path, name, mean_length, u.max(), np.mean(u > 1))


def test_dc_kernels_lower_to_triton_for_cuda_at_the_record_shape():
    T, H = 49152, 6
    x, w = jax.ShapeDtypeStruct((T, H, 128), BF16), jax.ShapeDtypeStruct((T, H), BF16)
    docs, scale = jax.ShapeDtypeStruct((T,), jnp.int32), jax.ShapeDtypeStruct((), F32)
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")

    def loss(y, q, k, v, docs, w1, w2, scale):
        return jnp.sum(m.pallas_add_dc_correction(y, q, k, v, docs, w1, w2, scale).astype(F32))

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 5, 6))).trace(x, x, x, x, docs, w, w, scale).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("@__gpu$xla.gpu.triton(") == 3
    for name in ("fwd", "dq", "dkv"):
        assert (f'name = "dc_{name}", num_stages = {m.PALLAS_DC.num_stages} : i32, '
                f"num_warps = {m.PALLAS_DC.num_warps} : i32") in text
    assert text.count(f"grid_x = {T // m.DC_ROWS} : i32, grid_y = 1 : i32") == 3
    assert "stablehlo.while" not in text


def test_rejects_bad_shapes_and_tiles():
    q = jnp.zeros((200, 2, K), BF16)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        m.pallas_window_attention(q, q, q, jnp.zeros(200, jnp.int32), 128, 0.1)
    q = jnp.zeros((256, 2, K), BF16)
    with pytest.raises(ValueError, match=r"docs shape \(128,\)"):
        m.pallas_window_attention(q, q, q, jnp.zeros(128, jnp.int32), 128, 0.1)
    with pytest.raises(ValueError, match="pass scalars"):
        m.pallas_window_attention(q, q, q, jnp.zeros(256, jnp.int32), jnp.zeros(2, jnp.int32), 0.1)
    with pytest.raises(ValueError, match="tile 48"):
        m.KernelTuning(tile=48, num_warps=4, num_stages=2)
    w = jnp.zeros((256, 2), BF16)
    with pytest.raises(ValueError, match=r"pallas_add_dc_correction: w1, w2 shapes \(256, 2\), \(256, 3\)"):
        m.pallas_add_dc_correction(q, q, q, q, jnp.zeros(256, jnp.int32), w, jnp.zeros((256, 3), BF16), 0.1)
    with pytest.raises(ValueError, match=r"y shape \(128, 2, 32\)"):
        m.pallas_add_dc_correction(q[:128], q, q, q, jnp.zeros(256, jnp.int32), w, w, 0.1)
