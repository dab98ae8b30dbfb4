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


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


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
            size = np.max(np.abs(r))
            # both round to bf16 at the same points (p before p·v, ds, the results): the pure-JAX
            # path's error is the yardstick, and the two stay within ~2 bf16 ulps of each other
            assert max_err(o, r) <= 1.25 * max_err(x, r) + 2**-10 * size, (name, window, max_err(o, r), max_err(x, r))
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
