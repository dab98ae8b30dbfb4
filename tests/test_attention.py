"""Block-sparse attention, both implementations (XLA path, Pallas kernel), against dense masked oracles
(fp32 and float64, the spec's token rule written out), and the kernel's CUDA lowering."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_gpt as tg


def allowed_mask(docs, window):
    """The spec's token rule as a dense T x T matrix: k <= q AND same doc AND q//128 - k//128 < max(W, 1)."""
    i = np.arange(len(docs))
    allowed = (i[None, :] <= i[:, None]) & (docs[:, None] == docs[None, :])
    return allowed & ((i[:, None] // 128 - i[None, :] // 128) < max(window, 1))


@jax.jit
def dense_attention(q, k, v, allowed):
    """Oracle: full T x T scores in fp32, masked by allowed_mask."""
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * 0.12
    p = jax.nn.softmax(jnp.where(allowed[None], s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32))


def random_case(rng, T, H=2, D=128):
    q, k, v = (jnp.asarray(rng.standard_normal((T, H, D)), jnp.bfloat16) for _ in range(3))
    # documents from a few tokens long to longer than the window
    n_docs = int(rng.integers(1, 12))
    starts = np.sort(rng.choice(np.arange(1, T), n_docs - 1, replace=False))
    tokens = rng.integers(0, 50000, T)
    tokens[starts] = tg.EOT
    tokens[0] = tg.EOT if rng.random() < 0.5 else tokens[0]
    docs = np.cumsum(tokens == tg.EOT).astype(np.int32)
    return q, k, v, tokens, docs


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def weighted_sum(attention):
    """attention -> (q, k, v, *rule, cotangent -> sum(attention(q, k, v, *rule) * cotangent)), for gradients."""
    return lambda q, k, v, *rule_and_cot: jnp.sum(attention(q, k, v, *rule_and_cot[:-1]).astype(jnp.float32)
                                                  * rule_and_cot[-1])


# one compiled program each, for every window and document layout below (they are runtime values)
ATTEND = jax.jit(tg.block_sparse_attention)
ATTEND_GRADS = jax.jit(jax.grad(weighted_sum(tg.block_sparse_attention), argnums=(0, 1, 2)))
DENSE_GRADS = jax.jit(jax.grad(weighted_sum(dense_attention), argnums=(0, 1, 2)))


@pytest.mark.parametrize("long_window", [1, 2, 3, 5, 8, 11, 14])
def test_matches_dense_oracle_outputs_and_gradients(long_window):
    rng = np.random.default_rng()
    T = 128 * 16
    q, k, v, _, docs = random_case(rng, T)
    for window in (long_window, long_window // 2):  # the long and the short (sw//2, may be 0) window
        w = jnp.int32(max(window, 1))  # the model passes max(sw_eff, 1), as the spec's rule does
        allowed = jnp.asarray(allowed_mask(docs, window))
        out = ATTEND(q, k, v, jnp.asarray(docs), w)
        ref = dense_attention(q, k, v, allowed)
        assert out.dtype == jnp.bfloat16 and out.shape == q.shape
        assert rel_err(out, ref) < 1e-2

        cot = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
        grads = ATTEND_GRADS(q, k, v, jnp.asarray(docs), w, cot)
        ref_grads = DENSE_GRADS(q, k, v, allowed, cot)
        for g, r in zip(grads, ref_grads):
            assert rel_err(g, r) < 2e-2


def test_future_tokens_and_other_documents_do_not_leak():
    rng = np.random.default_rng()
    T = 128 * 8
    q, k, v, _, _ = random_case(rng, T)
    tokens = rng.integers(0, 50000, T)
    cut = int(rng.integers(300, 700))  # document 2 starts here
    tokens[0], tokens[cut] = tg.EOT, tg.EOT
    docs = jnp.asarray(np.cumsum(tokens == tg.EOT), jnp.int32)
    attend = jax.jit(tg.block_sparse_attention)
    base = attend(q, k, v, docs, jnp.int32(8))
    t = int(rng.integers(cut + 10, T))  # change keys/values at a position of document 2
    k2 = k.at[t].set(jnp.asarray(rng.standard_normal(k.shape[1:]), jnp.bfloat16))
    v2 = v.at[t].set(jnp.asarray(rng.standard_normal(v.shape[1:]), jnp.bfloat16))
    changed = attend(q, k2, v2, docs, jnp.int32(8))
    # every query of document 1, and of document 2 before t, is unchanged; queries from t on see it
    np.testing.assert_array_equal(np.asarray(changed[:t], np.float32), np.asarray(base[:t], np.float32))
    assert not np.array_equal(np.asarray(changed[t:], np.float32), np.asarray(base[t:], np.float32))
    # changing a document-1 key leaves document 2 untouched
    s = int(rng.integers(0, cut))
    k3 = k.at[s].set(-k[s])
    other = attend(q, k3, v, docs, jnp.int32(8))
    np.testing.assert_array_equal(np.asarray(other[cut:], np.float32), np.asarray(base[cut:], np.float32))


def test_one_program_serves_every_window_and_long_sequences_fit():
    """The window is a runtime value (no recompile), and a 65,536-token sequence runs in O(T·W) memory."""
    fn = jax.jit(lambda *args: tg.block_sparse_attention(*args))  # a fresh cache
    T = 65536
    q = jnp.ones((T, 1, 128), jnp.bfloat16)
    docs = jnp.zeros((T,), jnp.int32)
    for w in (1, 3):
        out = fn(q, q, q, docs, jnp.int32(w))
    assert fn._cache_size() == 1
    np.testing.assert_allclose(np.asarray(out[-1], np.float32), 1.0)


# ----------------------------------------------------------------------------- Pallas kernel (issue 14)
# On CPU the kernels run in Pallas interpret mode (the same kernel code, executed by XLA). Compiling an
# interpret-mode kernel takes seconds, so the checks share one compiled program per sequence length.


def dense_attention_f64(q, k, v, docs, window, dout):
    """float64 oracle: out, lse (H x T, natural log) and the gradients of sum(out * dout)."""
    q, k, v, dout = (np.asarray(x, np.float64).transpose(1, 0, 2) for x in (q, k, v, dout))  # H x T x D
    T = q.shape[1]
    i = np.arange(T)
    allowed = (i[None, :] <= i[:, None]) & (docs[:, None] == docs[None, :])
    allowed &= (i[:, None] // 128 - i[None, :] // 128) < max(window, 1)
    s = np.where(allowed[None], q @ k.transpose(0, 2, 1) * 0.12, -np.inf)  # H x T x T (matmul: BLAS)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    p = e / e.sum(-1, keepdims=True)
    out = p @ v
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    ds = p * (dout @ v.transpose(0, 2, 1) - np.sum(dout * out, -1, keepdims=True)) * 0.12
    dq, dk, dv = ds @ k, ds.transpose(0, 2, 1) @ q, p.transpose(0, 2, 1) @ dout
    out, dq, dk, dv = (x.transpose(1, 0, 2) for x in (out, dq, dk, dv))  # back to T x H x D
    return out, lse, dq, dk, dv


def document_ids(rng, T, kind):
    """Nondecreasing document ids, as cumsum(tokens == EOT) makes them."""
    if kind == "one":
        return np.zeros(T, np.int32)
    if kind == "per block":
        return (np.arange(T) // 128).astype(np.int32)
    mean_length = {"random": 300, "shorter than a block": 40}[kind]
    return np.cumsum(rng.random(T) < 1 / mean_length).astype(np.int32)


def attention_inputs(rng, T, dtype, H=2):
    q, k, v, dout = (jnp.asarray(rng.standard_normal((T, H, 128)) * s, dtype) for s in (3, 1, 1, 1))
    return q, k, v, dout  # q x 3: larger logits exercise the online softmax's rescaling


@jax.jit
def pallas_everything(q, k, v, docs, window, dout):
    out, lse_HxT = tg._pallas_attention_forward(q, k, v, docs, window)
    _, vjp = jax.vjp(lambda q, k, v: tg.pallas_attention(q, k, v, docs, window), q, k, v)  # the custom_vjp
    return out, lse_HxT, *vjp(dout)


@jax.jit
def xla_everything(q, k, v, docs, window, dout):
    out, lse_NxHxB = tg._xla_attention_with_lse(q, k, v, docs, window)
    _, vjp = jax.vjp(lambda q, k, v: tg.block_sparse_attention(q, k, v, docs, window), q, k, v)
    lse_HxT = lse_NxHxB.transpose(1, 0, 2).reshape(q.shape[1], q.shape[0])
    return out, lse_HxT, *vjp(dout)


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("T, windows, docs_kind", [
    (1024, (1, 0), "random"),  # W // 2 = 0: clipped to 1
    (1024, (16,), "shorter than a block"),  # W > N: clipped to N = 8
    (2048, (3,), "per block"),
    (2048, (16, 8), "one"),  # a pure sliding window, and its W // 2
])
def test_pallas_matches_float64_oracle_as_closely_as_the_xla_path(T, windows, docs_kind):
    rng = np.random.default_rng()
    q, k, v, dout = attention_inputs(rng, T, jnp.bfloat16)
    docs = document_ids(rng, T, docs_kind)
    for window in windows:
        args = (q, k, v, jnp.asarray(docs), jnp.int32(window), dout)
        pallas, xla = pallas_everything(*args), xla_everything(*args)
        ref = dense_attention_f64(q, k, v, docs, window, dout)
        assert pallas[0].dtype == jnp.bfloat16 and pallas[0].shape == q.shape
        assert all(g.dtype == jnp.bfloat16 and g.shape == q.shape for g in pallas[2:])
        for name, p, x, r in zip(("out", "lse", "dq", "dk", "dv"), pallas, xla, ref):
            scale = np.max(np.abs(r))
            if name == "lse":  # fp32 in both paths: <= 4e-7 relative measured
                assert max_err(p, r) < 4e-6 * scale and max_err(p, x) < 4e-6 * scale, name
                continue
            # bf16 rounding at the XLA path's points: its error is the yardstick (measured ratio 1.00)
            assert max_err(p, r) <= 1.25 * max_err(x, r), (name, window, max_err(p, r), max_err(x, r))
            assert max_err(p, x) <= 2**-6 * scale, name  # within ~2 bf16 ulps of the XLA path


def test_pallas_fp32_with_other_tiles_matches_float64_oracle():
    """fp32 inputs isolate the kernels' logic from bf16 rounding; non-default tiles split blocks into
    tiles (the window is per block, the mask per token)."""
    rng = np.random.default_rng()
    T, window = 1024, 3
    q, k, v, dout = attention_inputs(rng, T, jnp.float32)
    docs = document_ids(rng, T, "shorter than a block")
    fwd = partial(tg._pallas_attention_forward, tuning=tg.KernelTuning(tile=32, num_warps=4, num_stages=2))
    bwd = partial(tg._pallas_attention_backward, dq_tuning=tg.KernelTuning(tile=16, num_warps=4, num_stages=2),
                  dkv_tuning=tg.KernelTuning(tile=128, num_warps=8, num_stages=2))

    @jax.jit
    def everything(q, k, v, docs, window, dout):
        out, lse = fwd(q, k, v, docs, window)
        return out, lse, *bwd(q, k, v, docs, window, out, lse, dout)

    ours = everything(q, k, v, jnp.asarray(docs), jnp.int32(window), dout)
    for name, p, r in zip(("out", "lse", "dq", "dk", "dv"), ours, dense_attention_f64(q, k, v, docs, window, dout)):
        assert p.dtype == jnp.float32
        # fp32 rounding of logits up to ~40 (q x 3): measured <= 3e-6 relative, as the XLA path in fp32
        assert max_err(p, r) < 1e-5 * np.max(np.abs(r)), (name, max_err(p, r))


def test_pallas_block_tables_visit_exactly_the_block_pairs_with_a_visible_key():
    rng = np.random.default_rng()
    N = 24
    T = 128 * N
    tables = jax.jit(tg._block_tables)
    n, j = np.arange(N)[:, None], np.arange(N)[None, :]
    i = np.arange(T)
    for kind in ("random", "shorter than a block", "one", "per block"):
        docs = document_ids(rng, T, kind)
        for window in (0, 1, 3, 7, 30):
            lo_N, hi_N = (np.asarray(t) for t in tables(jnp.asarray(docs), jnp.int32(window)))
            allowed = (i[None, :] <= i[:, None]) & (docs[:, None] == docs[None, :])
            allowed &= (i[:, None] // 128 - i[None, :] // 128) < max(window, 1)
            pairs_NxN = allowed.reshape(N, 128, N, 128).any(axis=(1, 3))  # [n, j]: query block n, key block j
            np.testing.assert_array_equal((lo_N[:, None] <= j) & (j <= n), pairs_NxN)  # forward and dq loops
            np.testing.assert_array_equal((j <= n) & (n <= hi_N[None, :]), pairs_NxN)  # dk/dv loop


def test_pallas_kernels_lower_to_triton_for_cuda_at_the_record_shape():
    """Lowers the forward and backward for CUDA without a GPU and without running anything at 65,536 tokens.
    jax >= 0.11 needs an abstract GPU for it; 0.10 accepts one too."""
    T, H = 65536, 6
    x = jax.ShapeDtypeStruct((T, H, 128), jnp.bfloat16)
    docs, window = jax.ShapeDtypeStruct((T,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="cuda")

    def loss(q, k, v, docs, window):
        return jnp.sum(tg.pallas_attention(q, k, v, docs, window).astype(jnp.float32))

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x, docs, window).lower(
            lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("@__gpu$xla.gpu.triton(") == 3  # the fwd, dq and dk/dv kernels as Triton custom calls
    for name, tuning in (("fwd", tg.PALLAS_FWD), ("dq", tg.PALLAS_DQ), ("dkv", tg.PALLAS_DKV)):
        assert (f'name = "attention_{name}", num_stages = {tuning.num_stages} : i32, '
                f"num_warps = {tuning.num_warps} : i32") in text
    assert text.count("grid_x = 512 : i32, grid_y = 6 : i32") == 3
    assert "stablehlo.while" not in text  # no interpret-mode kernel slipped in


def test_pallas_rejects_bad_shapes_and_tiles():
    q = jnp.zeros((200, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        tg.pallas_attention(q, q, q, jnp.zeros(200, jnp.int32), 1)
    q = jnp.zeros((256, 2, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"docs shape \(128,\)"):
        tg.pallas_attention(q, q, q, jnp.zeros(128, jnp.int32), 1)
    with pytest.raises(ValueError, match="tile 48"):
        tg.KernelTuning(tile=48, num_warps=4, num_stages=2)


def test_model_with_pallas_attention_matches_the_xla_path():
    """--attention pallas end to end: the same model loss and gradients as with the XLA path."""
    hp = dataclasses.replace(tg.PRESETS["cpu"], num_layers=6, seq_len=512)
    rng = np.random.default_rng()
    params = tg.init_params(hp, int(rng.integers(1 << 30)))
    for name, p in params.items():  # zero-initialised projections and head get values: non-trivial gradients
        if name.endswith("c_proj.weight") or name == "lm_head.weight":
            params[name] = jnp.asarray(rng.uniform(-0.05, 0.05, p.shape), p.dtype)
    tokens = rng.integers(0, 3000, 513)
    tokens[rng.random(513) < 1 / 100] = tg.EOT
    x, y = jnp.asarray(tokens[:-1], jnp.int32), jnp.asarray(tokens[1:], jnp.int32)
    results = {impl: jax.jit(jax.value_and_grad(lambda p: tg.loss_fn(p, x, y, jnp.int32(3), True, attention=impl)))(params)
               for impl in ("xla", "pallas")}
    (loss_x, grads_x), (loss_p, grads_p) = results["xla"], results["pallas"]
    assert abs(float(loss_x) - float(loss_p)) < 1e-3 * float(loss_x)
    # Measured: matrices at most 1-5% apart (max difference / max gradient), the scalars (compared
    # together: each is a cancelling sum over T x D terms) 1%; a window one block too wide: 31-78%.
    for name in params:
        if params[name].ndim >= 2:
            gx, gp = np.asarray(grads_x[name], np.float32), np.asarray(grads_p[name], np.float32)
            assert np.abs(gx - gp).max() <= 0.15 * np.abs(gx).max(), name
    gx, gp = (np.concatenate([np.asarray(g[k], np.float32) for k in params if params[k].ndim == 1])
              for g in (grads_x, grads_p))
    assert np.abs(gx - gp).max() <= 0.15 * np.abs(gx).max()
