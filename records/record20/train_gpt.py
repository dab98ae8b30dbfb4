"""The modded-nanogpt speedrun, record 20 ("sub-3-minute"), in JAX.

Trains a GPT-2-small-class model (rotary, QK-norm, ReLU², value embeddings, U-net skips,
softcapped FP8 head) with Muon + Adam on FineWeb until 3.28 validation loss.
Read top to bottom: 1 hyperparameters, 2 model, 3 optimizer, 4 data, 5 record log, 6 training.
Importing this file has no side effects; `python train_gpt.py --help` lists every option.
"""

import argparse
import dataclasses
import glob
import itertools
import json
import math
import os
import pathlib
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

SOURCE = pathlib.Path(__file__).read_text()  # read at start-up: the record log embeds the code that runs


# -----------------------------------------------------------------------------
# 1 Hyperparameters


class ConfigError(ValueError):
    """A flag or a combination of flags that cannot run; the message names the flag and the fix."""


class DataError(ValueError):
    """Shards or paths that cannot be used; the message names the file (absolute path) and the fix."""


EOT = 50256  # <|endoftext|>: starts every document
BLOCK = 128  # attention block size (tokens); sequences are multiples of it
HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # sorted glob, read once in order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760  # the same first tokens of the val shards at every validation
    # batch
    batch_size: int = 8 * 64 * 1024  # tokens per optimizer step, whatever the device count
    seq_len: int = 64 * 1024  # tokens per loss (one sequence); the reference's per-GPU share
    # model
    vocab_size: int = 50257  # embedding rows; the head is padded to a multiple of 128 (50304)
    num_layers: int = 12
    num_heads: int = 6  # head dim is fixed at 128 (the rotary rule is defined for it)
    model_dim: int = 768
    fp8_head: bool = True  # FP8 lm_head in training (eval always uses the bf16 head)
    attention: str = "xla"  # "xla" (pure JAX, the oracle) or "pallas" (fused Triton kernel; interpreted on CPU)
    # optimization
    num_iterations: int = 1393
    cooldown_frac: float = 0.4  # lr factor 1.0, then linear to final_lr_frac over this last part
    final_lr_frac: float = 0.1
    head_lr: float = 0.008
    embed_lr: float = 0.6
    scalar_lr: float = 0.04
    muon_lr: float = 0.05
    muon_momentum_warmup_steps: int = 300  # Muon momentum 0.85 -> 0.95 over these steps
    window_tokens: int = 1728  # attention window warmup: 1 block -> ceil(1728/128) = 14 blocks
    # evaluation, logging, compilation
    val_loss_every: int = 125  # 0: only at the end
    seed: int = 0
    records_dir: str = "records"
    compile_cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "train_gpt_jax")  # "" = off

    def __post_init__(self):
        """Every rule a run depends on, checked before any work (each message names the flag)."""
        problems = [message for ok, message in [
            (self.seq_len > 0 and self.seq_len % BLOCK == 0,
             f"--seq-len {self.seq_len} must be a positive multiple of {BLOCK} (the attention block size)"),
            (self.batch_size > 0 and self.seq_len > 0 and self.batch_size % self.seq_len == 0,
             f"--batch-size {self.batch_size} must be a positive multiple of --seq-len {self.seq_len}"),
            (self.val_tokens > 0 and self.batch_size > 0 and self.val_tokens % self.batch_size == 0,
             f"--val-tokens {self.val_tokens} must be a positive multiple of --batch-size {self.batch_size}"),
            (self.vocab_size > 0, f"--vocab-size {self.vocab_size} must be positive (check_inputs compares it with "
                                  f"the shards' largest token id)"),
            (self.num_layers >= 6 and self.num_layers % 2 == 0,
             f"--num-layers {self.num_layers}: the U-net needs an even number >= 6"),
            (self.num_heads > 0 and self.model_dim == self.num_heads * HEAD_DIM,
             f"--model-dim {self.model_dim} must equal --num-heads {self.num_heads} x {HEAD_DIM} (head dim is fixed), "
             f"with at least one head"),
            (self.num_iterations > 0, f"--num-iterations {self.num_iterations} must be at least 1"),
            (0 < self.cooldown_frac <= 1, f"--cooldown-frac {self.cooldown_frac} must be in (0, 1]"),
            (0 <= self.final_lr_frac <= 1, f"--final-lr-frac {self.final_lr_frac} must be in [0, 1]"),
            *[(lr >= 0 and math.isfinite(lr), f"--{name.replace('_', '-')} {lr} must be a finite number >= 0")
              for name, lr in [("head_lr", self.head_lr), ("embed_lr", self.embed_lr),
                               ("scalar_lr", self.scalar_lr), ("muon_lr", self.muon_lr)]],
            (self.muon_momentum_warmup_steps >= 0,
             f"--muon-momentum-warmup-steps {self.muon_momentum_warmup_steps} must be >= 0 (0: no warm-up)"),
            (self.window_tokens >= 0, f"--window-tokens {self.window_tokens} must be >= 0"),
            (self.val_loss_every >= 0, f"--val-loss-every {self.val_loss_every} must be >= 0 (0: only at the end)"),
            (self.attention in ("xla", "pallas"), f"--attention {self.attention!r}: choose xla or pallas"),
            (bool(self.train_files and self.val_files and self.records_dir),
             "--train-files, --val-files and --records-dir must not be empty"),
        ] if not ok]
        if problems:
            raise ConfigError("bad hyperparameters:\n  " + "\n  ".join(problems))

    @property
    def padded_vocab(self) -> int:
        return next_multiple(self.vocab_size, 128)


# Named presets: `record` is exactly record 20; `cpu` is the same architecture family at a size
# that trains visibly on 2 CPU cores in minutes (12 layers, one 128-dim head, 4 x 512-token sequences).
PRESETS = {
    "record": Hyperparameters(),
    "cpu": Hyperparameters(
        batch_size=4 * 512, seq_len=512, val_tokens=8 * 2048, model_dim=128, num_heads=1,
        num_iterations=100, window_tokens=512, val_loss_every=25,
    ),
}


def next_multiple(n: int, k: int) -> int:
    return -(-n // k) * k


# -----------------------------------------------------------------------------
# 2 Model: a pure function of a dict of arrays keyed by the PyTorch reference's state-dict names
#
# Shape suffixes (x_TxD): T tokens of a sequence, D model dim, H heads, K head dim (128), V vocabulary
# rows (padded to 50304), N 128-token blocks of a sequence, B tokens per block (128), C tokens of a
# loss chunk, F rotary frequencies, O x I a weight matrix's (out, in), R sequences per device (§6);
# in the attention kernels J and Q are the keys and queries of one loop tile.

ATTN_SCALE = 0.12
RMS_EPS = float(np.finfo(np.float32).eps)  # torch's F.rms_norm default for bf16/fp32 inputs
BF16 = jnp.bfloat16
F32 = jnp.float32


VALUE_EMBEDS = 3  # value-embedding tables


def value_embed_index(layer: int, num_layers: int):
    """The 012...012 pattern: the first three and the last three layers get value tables 0, 1, 2."""
    if layer < VALUE_EMBEDS:
        return layer
    if layer >= num_layers - VALUE_EMBEDS:
        return layer - (num_layers - VALUE_EMBEDS)
    return None


def has_attention(layer: int, num_layers: int) -> bool:
    return layer != num_layers // 2 + 1  # block 7 of 12 has only its MLP


def has_long_window(layer: int, num_layers: int) -> bool:
    """Encoder blocks use [long, short, short, short] repeated, the decoder the mirror image: 0, 4, 11 of 12."""
    half = num_layers // 2
    return (layer if layer < half else num_layers - 1 - layer) % 4 == 0


def init_params(hp: Hyperparameters, seed: int) -> dict:
    """Parameters with the spec's shapes, dtypes and init: bf16 embedding tables, fp32 everything else."""
    D, L, V = hp.model_dim, hp.num_layers, hp.vocab_size
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 2 * L))
    bound = 3**0.5 * 0.5 * D**-0.5  # = 0.03125 at D = 768 (CastedLinear's uniform init)

    def uniform(shape):
        return jax.random.uniform(next(keys), shape, F32, -bound, bound)

    params = {"embed.weight": jax.random.normal(next(keys), (V, D), F32).astype(BF16)}
    for k in range(VALUE_EMBEDS):
        params[f"value_embeds.embed.{k}.weight"] = jax.random.normal(next(keys), (V, D), F32).astype(BF16)
    for i in range(L):
        params[f"blocks.{i}.lambdas"] = jnp.array([1.0, 0.0], F32)
        if has_attention(i, L):
            params[f"blocks.{i}.attn.qkv_w"] = uniform((3, D, D))
            params[f"blocks.{i}.attn.lambdas"] = jnp.array([0.5, 0.5], F32)
            params[f"blocks.{i}.attn.c_proj.weight"] = jnp.zeros((D, D), F32)
        params[f"blocks.{i}.mlp.c_fc.weight"] = uniform((4 * D, D))
        params[f"blocks.{i}.mlp.c_proj.weight"] = jnp.zeros((D, 4 * D), F32)
    params["skip_weights"] = jnp.ones((L // 2,), F32)
    params["lm_head.weight"] = jnp.zeros((hp.padded_vocab, D), F32)
    return params


def rms_norm(x):
    """torch's F.rms_norm without weight: fp32 math, eps = fp32 machine epsilon, back to x's dtype."""
    x32 = x.astype(F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + RMS_EPS)).astype(x.dtype)


def linear(x, w_OxI):
    """x @ Wᵀ with the fp32 master weight cast to the activation dtype (CastedLinear)."""
    return x @ w_OxI.astype(x.dtype).T


def mix(*terms):
    """sum of s·x over (s, x) terms, s a scalar (0-d fp32 parameter or Python float), x an activation:
    computed in fp32 and rounded once to the first x's dtype, as torch.compile's fused kernels do for
    such elementwise chains. Why not s.astype(bf16)·x: that rounds s itself (3.4445 -> 3.4375), and
    makes a scalar parameter's gradient a bf16 sum over T·D products."""
    return sum(jnp.asarray(s, F32) * x.astype(F32) for s, x in terms).astype(terms[0][1].dtype)


def rotary_cos_sin(T: int, head_dim: int = HEAD_DIM):
    """Half-truncated RoPE tables (fp32): 32 frequencies (1/1024)^(j/31), then 32 zeros, absolute positions."""
    n = head_dim // 4
    freqs_F = jnp.concatenate([(1 / 1024) ** jnp.linspace(0, 1, n, dtype=F32), jnp.zeros(n, F32)])
    theta_TxF = jnp.arange(T, dtype=F32)[:, None] * freqs_F[None, :]
    return jnp.cos(theta_TxF), jnp.sin(theta_TxF)


def apply_rotary(x_TxHxK, cos_TxF, sin_TxF):
    x1, x2 = jnp.split(x_TxHxK.astype(F32), 2, axis=-1)
    cos, sin = cos_TxF[:, None, :], sin_TxF[:, None, :]
    y = jnp.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)
    return y.astype(x_TxHxK.dtype)


# Attention: allowed(q,k) = k <= q AND docs[q] == docs[k] AND floor(q/128) - floor(k/128) < W.
# Exact block-sparse flash attention in pure JAX: query block n only meets key blocks n-d for
# d < W, so memory is O(T·128) and compute O(T·W·128). W is a runtime value: a while loop runs W
# block-diagonals, so one compiled program serves every window. The backward pass is written out
# (custom_vjp, recomputing probabilities from the saved log-sum-exp) because autodiff of the loop
# would store every diagonal's scores.


def _blocks(x_TxHxK):
    T, H, K = x_TxHxK.shape
    return x_TxHxK.reshape(T // BLOCK, BLOCK, H, K).transpose(0, 2, 1, 3)  # N x H x B x K


def _unblocks(x_NxHxBxK):
    N, H, B, K = x_NxHxBxK.shape
    return x_NxHxBxK.transpose(0, 2, 1, 3).reshape(N * B, H, K)


def _diagonal(d, q_NxHxBxK, k_NxHxBxK, docs_NxB):
    """Scores and mask of each query block n against key block n - d (d-th block diagonal)."""
    N = q_NxHxBxK.shape[0]
    kd = jnp.roll(k_NxHxBxK, d, axis=0)  # kd[n] = k[n - d]; wrapped rows are masked below
    s_NxHxBxB = jnp.einsum("nhqd,nhkd->nhqk", q_NxHxBxK, kd, preferred_element_type=F32) * ATTN_SCALE
    i = jnp.arange(BLOCK)
    causal_BxB = (d > 0) | (i[None, :] <= i[:, None])
    same_doc_NxBxB = docs_NxB[:, :, None] == jnp.roll(docs_NxB, d, axis=0)[:, None, :]
    exists_N = jnp.arange(N) >= d
    mask_NxBxB = causal_BxB[None] & same_doc_NxBxB & exists_N[:, None, None]
    return s_NxHxBxB, mask_NxBxB[:, None]


def _xla_attention_with_lse(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window):
    q, k, v = _blocks(q_TxHxK), _blocks(k_TxHxK), _blocks(v_TxHxK)
    N, H, B, K = q.shape
    docs_NxB = docs_T.reshape(N, B)

    def diagonal(d, carry):
        m, l, acc = carry
        s, mask = _diagonal(d, q, k, docs_NxB)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))  # finite from d = 0 on: every query sees itself
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        vd = jnp.roll(v, d, axis=0)
        pv = jnp.einsum("nhqk,nhkd->nhqd", p.astype(v.dtype), vd, preferred_element_type=F32)
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    init = (jnp.full((N, H, B), -jnp.inf, F32), jnp.zeros((N, H, B), F32), jnp.zeros((N, H, B, K), F32))
    m, l, acc = jax.lax.fori_loop(0, jnp.clip(window, 1, N), diagonal, init)
    out = _unblocks(acc / l[..., None]).astype(q_TxHxK.dtype)
    return out, m + jnp.log(l)


@jax.custom_vjp
def block_sparse_attention(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window):
    """softmax(0.12·q·kᵀ)·v over the allowed (q, k) pairs; q, k, v bf16, fp32 softmax; window in blocks."""
    return _xla_attention_with_lse(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window)[0]


def _xla_attention_vjp_fwd(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window):
    out, lse = _xla_attention_with_lse(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window)
    return out, (q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, out, lse)


def _xla_attention_vjp_bwd(res, dout_TxHxK):
    q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, out_TxHxK, lse = res
    q, k, v, dout = _blocks(q_TxHxK), _blocks(k_TxHxK), _blocks(v_TxHxK), _blocks(dout_TxHxK)
    N, H, B, K = q.shape
    docs_NxB = docs_T.reshape(N, B)
    delta = jnp.sum(dout.astype(F32) * _blocks(out_TxHxK).astype(F32), axis=-1)  # N x H x B

    def diagonal(d, carry):
        dq, dk, dv = carry
        s, mask = _diagonal(d, q, k, docs_NxB)
        p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
        vd, kd = jnp.roll(v, d, axis=0), jnp.roll(k, d, axis=0)
        dp = jnp.einsum("nhqd,nhkd->nhqk", dout, vd, preferred_element_type=F32)
        ds = (p * (dp - delta[..., None]) * ATTN_SCALE).astype(q.dtype)
        dq = dq + jnp.einsum("nhqk,nhkd->nhqd", ds, kd, preferred_element_type=F32)
        dk_d = jnp.einsum("nhqk,nhqd->nhkd", ds, q, preferred_element_type=F32)
        dv_d = jnp.einsum("nhqk,nhqd->nhkd", p.astype(q.dtype), dout, preferred_element_type=F32)
        # row n of dk_d belongs to key block n - d: roll it back (rows n < d are zero)
        return dq, dk + jnp.roll(dk_d, -d, axis=0), dv + jnp.roll(dv_d, -d, axis=0)

    zeros = jnp.zeros((N, H, B, K), F32)
    dq, dk, dv = jax.lax.fori_loop(0, jnp.clip(window, 1, N), diagonal, (zeros, zeros, zeros))
    grads = [_unblocks(g).astype(q_TxHxK.dtype) for g in (dq, dk, dv)]
    return (*grads, None, None)


block_sparse_attention.defvjp(_xla_attention_vjp_fwd, _xla_attention_vjp_bwd)


# The same attention as fused Pallas kernels (Triton on GPUs); the caller picks this or the XLA path.
# Grid (query block n of BLOCK tokens, head h). The runtime window never reaches a kernel: XLA turns
# (W, docs) into two int32 tables, so one compiled kernel serves every window:
#   lo_N[n] = first key block query block n sees, hi_N[j] = last query block that sees key block j.
# Both also drop the blocks a document boundary masks entirely (as FlexAttention's block mask does)
# and test the same two conditions, so the forward and dq kernels (key blocks lo_N[n]..n) and the
# dk/dv kernel (query blocks j..hi_N[j]) visit the same block pairs; the token mask does the rest.
# k, v (q, dout for dk/dv) stay whole-sequence refs in HBM; a loop step loads `tile` rows of them.
# Off GPU the same kernels run in Pallas interpret mode: exact, slow, for tests.

LOG2_E = math.log2(math.e)  # scores are kept in log2 units: exp2 is one GPU instruction, exp is several
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked row never computes inf - inf


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Triton knobs of one kernel. tile: rows of the looped-over operand loaded per loop step
    (k, v in the forward and dq kernels; q, dout in the dk/dv kernel)."""

    tile: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        if self.tile not in (16, 32, 64, 128):  # a power of two (Triton), >= 16 (MMA), dividing BLOCK
            raise ValueError(f"KernelTuning tile {self.tile}: use 16, 32, 64 or 128")


# Starting points, not yet tuned on a GPU. At 8 warps an fp32 128 x 128 tile is 64 registers per
# thread: the forward holds its accumulator and 128 x tile scores (tile 128, 8 warps: jax's mha
# forward defaults); dq holds one and dk/dv two 128 x 128 accumulators, so their tiles are halved.
# Two stages of the forward's k and v tiles take 128 KB of the H100's 227 KB shared memory.
PALLAS_FWD = KernelTuning(tile=128, num_warps=8, num_stages=2)
PALLAS_DQ = KernelTuning(tile=64, num_warps=8, num_stages=2)
PALLAS_DKV = KernelTuning(tile=64, num_warps=8, num_stages=2)


def _block_tables(docs_T, window):
    """(lo_N, hi_N) int32. Key block j meets query block n >= j iff n - j < W and they share a document,
    which for nondecreasing docs is last doc of block j >= first doc of block n."""
    N = docs_T.shape[0] // BLOCK
    docs_NxB = docs_T.reshape(N, BLOCK)
    first_N, last_N = docs_NxB[:, 0], docs_NxB[:, -1]
    n_N = jnp.arange(N, dtype=jnp.int32)
    w = jnp.clip(window, 1, N).astype(jnp.int32)
    lo_doc_N = jnp.searchsorted(last_N, first_N, side="left", method="compare_all")
    hi_doc_N = jnp.searchsorted(first_N, last_N, side="right", method="compare_all") - 1
    return jnp.maximum(n_N - w + 1, lo_doc_N).astype(jnp.int32), jnp.minimum(n_N + w - 1, hi_doc_N).astype(jnp.int32)


def _dot_nt(a, b):  # a @ b.T, fp32 accumulation
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _dot_nn(a, b):  # a @ b, fp32 accumulation
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _visible(q_pos, q_docs, k_pos, k_docs):
    # inside a visited block pair the window holds already (tables); causal and same document remain
    return (q_pos >= k_pos) & (q_docs == k_docs)


def _fwd_kernel(lo_ref, docs_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *, tile):
    n = pl.program_id(0)
    q_BxK = q_ref[...]
    q_pos_B = n * BLOCK + jnp.arange(BLOCK)
    q_docs_B = docs_ref[pl.ds(pl.multiple_of(n * BLOCK, BLOCK), BLOCK)]

    def step(i, carry):  # tile i counts back from the diagonal: with tile = BLOCK each row sees itself first
        acc_BxK, m_B, l_B = carry
        k_start = pl.multiple_of((n + 1) * BLOCK - (i + 1) * tile, tile)
        ks = pl.ds(k_start, tile)
        s_BxJ = _dot_nt(q_BxK, k_ref[ks, :]) * (ATTN_SCALE * LOG2_E)
        k_pos_J = k_start + jnp.arange(tile)
        visible = _visible(q_pos_B[:, None], q_docs_B[:, None], k_pos_J[None, :], docs_ref[ks][None, :])
        s_BxJ = jnp.where(visible, s_BxJ, MASK_VALUE)
        m_new_B = jnp.maximum(m_B, s_BxJ.max(axis=1))
        p_BxJ = jnp.exp2(s_BxJ - m_new_B[:, None])
        alpha_B = jnp.exp2(m_B - m_new_B)  # 0 when a row meets its first visible key: drops the junk of masked tiles
        v_JxK = v_ref[ks, :]
        acc_BxK = acc_BxK * alpha_B[:, None] + _dot_nn(p_BxJ.astype(v_JxK.dtype), v_JxK)
        return acc_BxK, m_new_B, l_B * alpha_B + p_BxJ.sum(axis=1)

    init = (jnp.zeros(q_BxK.shape, F32), jnp.full((BLOCK,), MASK_VALUE, F32), jnp.zeros((BLOCK,), F32))
    acc_BxK, m_B, l_B = jax.lax.fori_loop(0, (n - lo_ref[n] + 1) * (BLOCK // tile), step, init)
    out_ref[...] = (acc_BxK / l_B[:, None]).astype(out_ref.dtype)
    lse_ref[...] = m_B / LOG2_E + jnp.log(l_B)


def _dq_kernel(lo_ref, docs_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, dq_ref, *, tile):
    n = pl.program_id(0)
    q_BxK, dout_BxK = q_ref[...], dout_ref[...]
    lse_B, delta_B = lse_ref[...] * LOG2_E, delta_ref[...]
    q_pos_B = n * BLOCK + jnp.arange(BLOCK)
    q_docs_B = docs_ref[pl.ds(pl.multiple_of(n * BLOCK, BLOCK), BLOCK)]
    lo = lo_ref[n]

    def step(i, dq_BxK):
        k_start = pl.multiple_of(lo * BLOCK + i * tile, tile)
        ks = pl.ds(k_start, tile)
        k_JxK = k_ref[ks, :]
        s_BxJ = _dot_nt(q_BxK, k_JxK) * (ATTN_SCALE * LOG2_E)
        k_pos_J = k_start + jnp.arange(tile)
        visible = _visible(q_pos_B[:, None], q_docs_B[:, None], k_pos_J[None, :], docs_ref[ks][None, :])
        p_BxJ = jnp.where(visible, jnp.exp2(s_BxJ - lse_B[:, None]), 0.0)
        ds_BxJ = p_BxJ * (_dot_nt(dout_BxK, v_ref[ks, :]) - delta_B[:, None]) * ATTN_SCALE
        return dq_BxK + _dot_nn(ds_BxJ.astype(k_JxK.dtype), k_JxK)

    dq_BxK = jax.lax.fori_loop(0, (n - lo + 1) * (BLOCK // tile), step, jnp.zeros(q_BxK.shape, F32))
    dq_ref[...] = dq_BxK.astype(dq_ref.dtype)


def _dkv_kernel(hi_ref, docs_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, tile):
    # works on transposed scores (keys x queries) so that every product is a @ b or a @ b.T
    j = pl.program_id(0)
    k_BxK, v_BxK = k_ref[...], v_ref[...]
    k_pos_B = j * BLOCK + jnp.arange(BLOCK)
    k_docs_B = docs_ref[pl.ds(pl.multiple_of(j * BLOCK, BLOCK), BLOCK)]

    def step(i, carry):
        dk_BxK, dv_BxK = carry
        q_start = pl.multiple_of(j * BLOCK + i * tile, tile)
        qs = pl.ds(q_start, tile)
        q_QxK, dout_QxK = q_ref[qs, :], dout_ref[qs, :]
        lse_Q, delta_Q = lse_ref[qs] * LOG2_E, delta_ref[qs]
        s_BxQ = _dot_nt(k_BxK, q_QxK) * (ATTN_SCALE * LOG2_E)
        q_pos_Q = q_start + jnp.arange(tile)
        visible = _visible(q_pos_Q[None, :], docs_ref[qs][None, :], k_pos_B[:, None], k_docs_B[:, None])
        p_BxQ = jnp.where(visible, jnp.exp2(s_BxQ - lse_Q[None, :]), 0.0)
        dv_BxK = dv_BxK + _dot_nn(p_BxQ.astype(dout_QxK.dtype), dout_QxK)
        ds_BxQ = p_BxQ * (_dot_nt(v_BxK, dout_QxK) - delta_Q[None, :]) * ATTN_SCALE
        return dk_BxK + _dot_nn(ds_BxQ.astype(q_QxK.dtype), q_QxK), dv_BxK

    zeros = jnp.zeros(k_BxK.shape, F32)
    dk_BxK, dv_BxK = jax.lax.fori_loop(0, (hi_ref[j] - j + 1) * (BLOCK // tile), step, (zeros, zeros))
    dk_ref[...] = dk_BxK.astype(dk_ref.dtype)
    dv_ref[...] = dv_BxK.astype(dv_ref.dtype)


def _pallas(kernel, tuning, name, **call):
    """The kernel as Triton when lowered for CUDA (explicit Triton params: jax 0.10 would pick Mosaic GPU),
    anywhere else the same kernel in interpret mode."""
    def build(interpret):
        params = pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
        return pl.pallas_call(partial(kernel, tile=tuning.tile), compiler_params=params, interpret=interpret,
                              name=name, **call)

    return lambda *args: jax.lax.platform_dependent(*args, cuda=build(False), default=build(True))


def _pallas_specs(T, K):
    """Block specs over the grid (n, h): tables, docs, block n of head h, all of head h, and the same
    two for H x T rows (lse, delta)."""
    whole = lambda n, h: (0,)  # noqa: E731
    return (pl.BlockSpec((T // BLOCK,), whole), pl.BlockSpec((T,), whole),
            pl.BlockSpec((BLOCK, None, K), lambda n, h: (n, h, 0)), pl.BlockSpec((T, None, K), lambda n, h: (0, h, 0)),
            pl.BlockSpec((None, BLOCK), lambda n, h: (h, n)), pl.BlockSpec((None, T), lambda n, h: (h, 0)))


def _check_pallas_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T):
    T, H, K = q_TxHxK.shape
    problems = []
    if k_TxHxK.shape != q_TxHxK.shape or v_TxHxK.shape != q_TxHxK.shape:
        problems.append(f"q, k, v shapes {q_TxHxK.shape}, {k_TxHxK.shape}, {v_TxHxK.shape} differ: pass (T, H, K) each")
    if T % BLOCK:
        problems.append(f"T = {T} is not a multiple of {BLOCK}: pad the sequence")
    if K not in (16, 32, 64, 128, 256):
        problems.append(f"head dim {K}: Triton needs a power of two in 16..256")
    if docs_T.shape != (T,):
        problems.append(f"docs shape {docs_T.shape}: pass one document id per token, ({T},)")
    if problems:
        raise ValueError("pallas_attention: " + "; ".join(problems))
    return T, H, K


def _pallas_attention_forward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, tuning=PALLAS_FWD):
    """(out_TxHxK, lse_HxT). lse_HxT[h, t] = natural log of the softmax denominator of query t in head h
    (fp32, head-major: the XLA path's N x H x B lse transposed to H x N x B, reshaped)."""
    T, H, K = _check_pallas_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T)
    lo_N, _ = _block_tables(docs_T, window)
    table, docs, blk, seq, rows_blk, _ = _pallas_specs(T, K)
    out_shape = (jax.ShapeDtypeStruct.like(q_TxHxK), jax.ShapeDtypeStruct((H, T), F32))
    call = _pallas(_fwd_kernel, tuning, "attention_fwd", grid=(T // BLOCK, H), out_shape=out_shape,
                   in_specs=[table, docs, blk, seq, seq], out_specs=(blk, rows_blk))
    return call(lo_N, docs_T, q_TxHxK, k_TxHxK, v_TxHxK)


def _pallas_attention_backward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, out_TxHxK, lse_HxT, dout_TxHxK,
                               dq_tuning=PALLAS_DQ, dkv_tuning=PALLAS_DKV):
    """(dq, dk, dv) from the saved lse; delta = rowsum(out * dout) is cheap in XLA."""
    T, H, K = q_TxHxK.shape
    lo_N, hi_N = _block_tables(docs_T, window)
    delta_HxT = jnp.einsum("thd,thd->ht", out_TxHxK.astype(F32), dout_TxHxK.astype(F32))
    table, docs, blk, seq, rows_blk, rows_seq = _pallas_specs(T, K)
    like = jax.ShapeDtypeStruct.like
    dq = _pallas(_dq_kernel, dq_tuning, "attention_dq", grid=(T // BLOCK, H), out_shape=like(q_TxHxK),
                 in_specs=[table, docs, blk, seq, seq, blk, rows_blk, rows_blk], out_specs=blk)
    dkv = _pallas(_dkv_kernel, dkv_tuning, "attention_dkv", grid=(T // BLOCK, H),
                  out_shape=(like(k_TxHxK), like(v_TxHxK)),
                  in_specs=[table, docs, seq, blk, blk, seq, rows_seq, rows_seq], out_specs=(blk, blk))
    args = (docs_T, q_TxHxK, k_TxHxK, v_TxHxK, dout_TxHxK, lse_HxT, delta_HxT)
    return (dq(lo_N, *args), *dkv(hi_N, *args))


@jax.custom_vjp
def pallas_attention(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window):
    """block_sparse_attention as a Pallas kernel (same rule, arguments and result). docs_T must be
    nondecreasing (as cumsum(tokens == EOT) is): the block tables rely on it."""
    return _pallas_attention_forward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window)[0]


def _pallas_attention_vjp_fwd(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window):
    out, lse_HxT = _pallas_attention_forward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window)
    return out, (q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, out, lse_HxT)


def _pallas_attention_vjp_bwd(res, dout_TxHxK):
    return (*_pallas_attention_backward(*res, dout_TxHxK), None, None)


pallas_attention.defvjp(_pallas_attention_vjp_fwd, _pallas_attention_vjp_bwd)


ATTENTION = {"xla": block_sparse_attention, "pallas": pallas_attention}  # --attention: the same rule


def causal_self_attention(params, i, x_TxD, ve_TxD, docs_T, window, cos, sin, attend):
    T, D = x_TxD.shape
    H = D // HEAD_DIM
    qkv_w = params[f"blocks.{i}.attn.qkv_w"]  # (3, D, D): [W_q; W_k; W_v], each (out, in)
    qkv_Tx3HxK = linear(x_TxD, qkv_w.reshape(3 * D, D)).reshape(T, 3 * H, HEAD_DIM)
    q, k, v = jnp.split(qkv_Tx3HxK, 3, axis=1)
    lambdas = params[f"blocks.{i}.attn.lambdas"]
    v = mix((lambdas[0], v)) if ve_TxD is None else mix((lambdas[0], v), (lambdas[1], ve_TxD.reshape(T, H, HEAD_DIM)))
    q, k = apply_rotary(rms_norm(q), cos, sin), apply_rotary(rms_norm(k), cos, sin)
    y_TxHxK = attend(q, k, v, docs_T, window)
    return linear(y_TxHxK.reshape(T, D), params[f"blocks.{i}.attn.c_proj.weight"])


def mlp(params, i, x_TxD):
    h = jax.nn.relu(linear(x_TxD, params[f"blocks.{i}.mlp.c_fc.weight"]))
    return linear(h * h, params[f"blocks.{i}.mlp.c_proj.weight"])


def num_layers_of(params) -> int:
    return sum(name.endswith(".lambdas") and ".attn." not in name for name in params)


def block(params, i, x, x0, ve, docs_T, window, cos, sin, attend):
    """One transformer block: x0 mixing, attention (all blocks but one), ReLU² MLP."""
    lambdas = params[f"blocks.{i}.lambdas"]
    x = mix((lambdas[0], x), (lambdas[1], x0))
    if has_attention(i, num_layers_of(params)):
        x = x + causal_self_attention(params, i, rms_norm(x), ve, docs_T, window, cos, sin, attend)
    return x + mlp(params, i, rms_norm(x))


def gpt_hidden(params, inputs_T, window, attention: str = "xla", dtype=BF16):
    """The transformer up to the final norm: token ids (T,) -> normed hidden states (T, D) in `dtype`
    (bf16 as the reference; F32 runs the whole model in fp32, the yardstick of the numerics tests)."""
    L = num_layers_of(params)
    T = inputs_T.shape[0]
    docs_T = jnp.cumsum(inputs_T == EOT, dtype=jnp.int32)  # a 50256 token opens its document
    long_window = jnp.maximum(window, 1)
    short_window = jnp.maximum(window // 2, 1)
    cos, sin = rotary_cos_sin(T)
    x0 = rms_norm(params["embed.weight"][inputs_T].astype(dtype))
    ves = [params[f"value_embeds.embed.{k}.weight"][inputs_T].astype(dtype) for k in range(VALUE_EMBEDS)]
    x, skips = x0, []
    for i in range(L):
        if i >= L // 2:  # decoder: add the mirrored encoder block's output (U-net)
            x = mix((1.0, x), (params["skip_weights"][i - L // 2], skips.pop()))
        ve_index = value_embed_index(i, L)
        ve = None if ve_index is None else ves[ve_index]
        layer_window = long_window if has_long_window(i, L) else short_window
        x = block(params, i, x, x0, ve, docs_T, layer_window, cos, sin, ATTENTION[attention])
        if i < L // 2:
            skips.append(x)
    return rms_norm(x)


# FP8 lm_head (training only). Operands scaled into the e4m3 range (x·2, W·32); the backward
# scales the logit gradient by 2^29 into e5m2. That scale assumes 65,536 tokens per loss (each
# logit gradient is at most 1/T); for other T it is scaled by T/65,536 so e5m2 neither overflows
# nor underflows (fp8_grad_scale).
X_SCALE, W_SCALE = 2.0, 32.0


def fp8_grad_scale(tokens_per_loss: int) -> float:
    return 2.0**29 * tokens_per_loss / 65536


def _fast_accum():
    # Hopper's reduced-precision fp8 accumulation (use_fast_accum=True); CPU emulation has no such mode.
    return jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32_FAST_ACCUM if jax.default_backend() == "gpu" else None


def _fp8_dot(a, b, contract, precision=None):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=F32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp8_head(x_TxD, w_VxD, grad_scale):
    """z = x·Wᵀ through e4m3 operands, bf16 result."""
    return _fp8_head_fwd(x_TxD, w_VxD, grad_scale)[0]


def _fp8_head_fwd(x_TxD, w_VxD, grad_scale):
    x8 = (x_TxD * X_SCALE).astype(jnp.float8_e4m3fn)
    w8 = (w_VxD * W_SCALE).astype(jnp.float8_e4m3fn)
    z = _fp8_dot(x8, w8, ((1,), (1,)), _fast_accum()) * (1 / (X_SCALE * W_SCALE))
    return z.astype(BF16), (x8, w8)


def _fp8_head_bwd(grad_scale, res, g_TxV):
    x8, w8 = res
    g8 = (g_TxV * grad_scale).astype(jnp.float8_e5m2)
    dx = _fp8_dot(g8, w8, ((1,), (0,))) * (1 / (grad_scale * W_SCALE))
    dw = _fp8_dot(g8, x8, ((0,), (0,))) * (1 / (grad_scale * X_SCALE))
    return dx.astype(BF16), dw  # dW stays fp32, like the master weight


fp8_head.defvjp(_fp8_head_fwd, _fp8_head_bwd)

LOSS_CHUNK_TOKENS = 8192  # head + loss run over chunks so 64K x 50304 fp32 logits never coexist


def head_loss(h_TxD, w_VxD, targets_T, use_fp8: bool):
    """Mean cross-entropy of logits 30·sigmoid(z/7.5) (fp32) over all padded-vocab columns."""
    T, D = h_TxD.shape
    chunk = math.gcd(T, LOSS_CHUNK_TOKENS)
    grad_scale = fp8_grad_scale(T)

    @jax.checkpoint  # the backward recomputes one chunk's logits at a time
    def chunk_loss(args):
        h_CxD, t_C = args
        z = fp8_head(h_CxD, w_VxD, grad_scale) if use_fp8 else linear(h_CxD, w_VxD)
        logits = 30 * jax.nn.sigmoid(z.astype(F32) / 7.5)
        picked = jnp.take_along_axis(logits, t_C[:, None], axis=-1)[:, 0]
        return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - picked)

    sums = jax.lax.map(chunk_loss, (h_TxD.reshape(-1, chunk, D), targets_T.reshape(-1, chunk)))
    return jnp.sum(sums) / T


def loss_fn(params, inputs_T, targets_T, window, training: bool, fp8: bool = True, attention: str = "xla",
            dtype=BF16):
    """Mean next-token loss of one sequence (int32 (T,), T a multiple of 128); window: the long
    attention window in blocks. The FP8 head is a training-only path; evaluation (training=False)
    always uses the plain bf16 head."""
    h_TxD = gpt_hidden(params, inputs_T, window, attention, dtype)
    return head_loss(h_TxD, params["lm_head.weight"], targets_T, use_fp8=training and fp8)


# -----------------------------------------------------------------------------
# 3 Optimizer: Adam (optax) for the head, embeddings and scalars; hand-written Muon for the
# matrices inside the blocks. One lr factor for every group; Muon momentum warms up.


def lr_factor(step, hp: Hyperparameters):
    """1.0, then linear down to final_lr_frac over the last cooldown_frac of training."""
    w = jnp.minimum((1 - step / hp.num_iterations) / hp.cooldown_frac, 1.0)
    return w + (1 - w) * hp.final_lr_frac


def muon_momentum(step, hp: Hyperparameters):
    """0.85 -> 0.95 linearly over muon_momentum_warmup_steps, then 0.95 (0 steps: 0.95 from the start)."""
    warmed = 1.0 if hp.muon_momentum_warmup_steps == 0 else jnp.minimum(step / hp.muon_momentum_warmup_steps, 1.0)
    return 0.85 + 0.10 * warmed


def window_blocks(step: int, hp: Hyperparameters) -> int:
    """Long attention window in 128-token blocks at a step: max(1, ceil(1728·s/N/128)); short = long // 2."""
    return max(1, -(-hp.window_tokens * step // (hp.num_iterations * BLOCK)))


NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G_SxOxI, steps: int = 5):
    """Quintic Newton–Schulz in bf16 on a stack (S) of matrices: pushes each matrix's singular values into ~[0.5, 1.5]."""
    a, b, c = NS_COEFFS
    X = G_SxOxI.astype(BF16)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.swapaxes(-2, -1)
    norm = jnp.sqrt(jnp.sum(jnp.square(X.astype(F32)), axis=(-2, -1), keepdims=True))
    X = (X.astype(F32) / (norm + 1e-7)).astype(BF16)
    # The reference's NS is torch.compile'd: inductor computes each elementwise chain in fp32 and rounds
    # once where it stores (mix); its b·A + c·A @ A is b·A + (c·A) @ A by Python's precedence.
    for _ in range(steps):
        A = X @ X.swapaxes(-2, -1)
        B = mix((b, A), (1.0, mix((c, A)) @ A))
        X = mix((a, X), (1.0, B @ X))
    return X.swapaxes(-2, -1) if tall else X


def orthogonalize(updates: list, mesh=None) -> list:
    """NS5 on every matrix of every update (qkv_w's Q, K, V separately), batched by shape.

    Matrices are made wide (tall ones transposed), stacked by shape and, on a multi-device mesh,
    sharded along the stack so each device orthogonalises its share; the result is replicated.
    """
    n_dev = 1 if mesh is None else mesh.size
    groups = {}  # wide shape -> list of (update index, matrix index, transposed, matrix)
    for u_index, u in enumerate(updates):
        for m_index, m in enumerate(u.reshape(-1, *u.shape[-2:])):
            tall = m.shape[0] > m.shape[1]
            mat = m.T if tall else m
            groups.setdefault(mat.shape, []).append((u_index, m_index, tall, mat))
    out = [[None] * (u.size // (u.shape[-2] * u.shape[-1])) for u in updates]
    for items in groups.values():
        stack = jnp.stack([mat for *_, mat in items])
        pad = (-len(items)) % n_dev
        if n_dev > 1:
            stack = jnp.concatenate([stack, jnp.zeros((pad, *stack.shape[1:]), stack.dtype)])
            stack = jax.lax.with_sharding_constraint(stack, NamedSharding(mesh, P(mesh.axis_names[0])))
        ortho = newton_schulz(stack)
        if n_dev > 1:
            ortho = jax.lax.with_sharding_constraint(ortho, NamedSharding(mesh, P()))
        for (u_index, m_index, tall, _), o in zip(items, ortho):
            out[u_index][m_index] = o.T if tall else o
    return [jnp.stack(mats).reshape(u.shape) for mats, u in zip(out, updates)]


def muon(learning_rate, momentum, mesh=None) -> optax.GradientTransformation:
    """Muon: fp32 momentum, Nesterov, NS5-orthogonalised update scaled by sqrt(max(1, rows/cols)).

    learning_rate(step) and momentum(step) are schedules of the 0-based step count.
    """

    def init(params):
        return {"count": jnp.zeros((), jnp.int32), "momentum": jax.tree.map(lambda p: jnp.zeros_like(p, F32), params)}

    def update(grads, state, params=None):
        step = state["count"]
        m = momentum(step)
        buf = jax.tree.map(lambda b, g: m * b + (1 - m) * g.astype(F32), state["momentum"], grads)
        nesterov = jax.tree.map(lambda b, g: (1 - m) * g.astype(F32) + m * b, buf, grads)
        leaves, treedef = jax.tree.flatten(nesterov)
        lr = learning_rate(step)
        updates = [
            -lr * max(1.0, u.shape[-2] / u.shape[-1]) ** 0.5 * o.astype(F32)
            for u, o in zip(leaves, orthogonalize(leaves, mesh))
        ]
        return jax.tree.unflatten(treedef, updates), {"count": step + 1, "momentum": buf}

    return optax.GradientTransformation(init, update)


def fp32_math(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run `inner` in fp32 and store its state back in the state's own dtype (bf16 for bf16
    embeddings), as torch's fused Adam does for bf16 parameters."""

    def up(tree):
        return jax.tree.map(lambda x: x.astype(F32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update(grads, state, params=None):
        updates, new_state = inner.update(up(grads), up(state), up(params))
        return updates, jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)

    return optax.GradientTransformation(inner.init, update)


def param_group(name: str, p) -> str:
    if name == "lm_head.weight":
        return "head"
    if name.startswith(("embed.", "value_embeds.")):
        return "embed"
    return "scalar" if p.ndim < 2 else "muon"


def make_optimizer(hp: Hyperparameters, mesh=None) -> optax.GradientTransformation:
    def adam(base_lr):
        return optax.adam(lambda s: base_lr * lr_factor(s, hp), b1=0.8, b2=0.95, eps=1e-10)

    groups = {
        "head": adam(hp.head_lr),
        "embed": fp32_math(adam(hp.embed_lr)),
        "scalar": adam(hp.scalar_lr),
        "muon": muon(lambda s: hp.muon_lr * lr_factor(s, hp), lambda s: muon_momentum(s, hp), mesh),
    }
    return optax.multi_transform(groups, lambda params: {k: param_group(k, p) for k, p in params.items()})


# -----------------------------------------------------------------------------
# Weights interop: .npz keyed by the PyTorch reference's state-dict names and shapes (Linear
# weights (out, in)). bf16 tables are stored as fp32 (exact) so any numpy or torch can read them.


def save_weights(params: dict, path: str) -> None:
    """Written under a temporary name and renamed, so PATH is either the old file or the complete new one."""
    arrays = {k: np.asarray(jax.device_get(v).astype(np.float32)) for k, v in params.items()}
    tmp = path + ".tmp.npz"
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_weights(path: str, hp: Hyperparameters) -> dict:
    expected = jax.eval_shape(lambda: init_params(hp, 0))
    try:
        with np.load(path) as f:
            arrays = dict(f)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"cannot read weights {os.path.abspath(path)} ({type(e).__name__}: {e}): pass an .npz "
                        f"written by --save-weights") from None
    missing, unexpected = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    wrong = [f"{k}: file {arrays[k].shape}, model {expected[k].shape}" for k in expected
             if k in arrays and arrays[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise DataError(f"{path} does not match the model of these hyperparameters: missing {missing}, "
                         f"unexpected {unexpected}, wrong shapes {wrong}")
    return {k: jnp.asarray(arrays[k], dtype=expected[k].dtype) for k in expected}


# -----------------------------------------------------------------------------
# 4 Data: the reference's loader. Each step takes a window of batch_size + 1 tokens from the
# current shard and splits it into R = batch_size / seq_len "virtual ranks": row r is
# tokens[pos + r·seq_len : pos + (r+1)·seq_len + 1] (inputs = first seq_len, targets = last
# seq_len). Then pos += batch_size; when pos + batch_size + 1 >= len(shard) the next shard starts
# at 0. The token order is therefore the 8-GPU reference's on any number of devices.


# The shard format that data/shards.py writes: 256 little-endian int32 (magic, version, token count,
# zeros), then the uint16 tokens. Read here as well, so this file runs and is logged on its own.
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_BYTES = 20240520, 1, 256 * 4
SHARD_FIX = ("delete it, then download it again (python data/cached_fineweb10B.py N) or regenerate it "
             "(data/fineweb.py, data/synthetic.py)")


def read_shard_header(path: str) -> int:
    """Check a shard's magic, version and size; its token count."""
    path = os.path.abspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(SHARD_HEADER_BYTES), "<i4")
    except OSError as e:
        raise DataError(f"cannot read shard {path}: {e.strerror}") from None
    if size < SHARD_HEADER_BYTES:
        raise DataError(f"{path} is {size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte shard header: {SHARD_FIX}")
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise DataError(f"{path} is not a version-{SHARD_VERSION} token shard (magic {header[0]}, version "
                        f"{header[1]}; expected {SHARD_MAGIC}, {SHARD_VERSION}): {SHARD_FIX}")
    count = int(header[2])
    if size != SHARD_HEADER_BYTES + 2 * count:
        raise DataError(f"{path} is {size} bytes but its header says {count} tokens "
                        f"({SHARD_HEADER_BYTES + 2 * count} bytes): truncated or corrupt; {SHARD_FIX}")
    return count


def open_shard(path: str) -> np.ndarray:
    """The shard's tokens as a read-only uint16 memory map, after checking its header."""
    count = read_shard_header(path)
    return np.memmap(path, "<u2", "r", SHARD_HEADER_BYTES, (count,)) if count else np.zeros(0, "<u2")


def shard_files(pattern: str, flag: str) -> list:
    """The sorted files matching a glob; relative patterns are relative to the current folder."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(
            f"no shards match {flag} {os.path.abspath(pattern)!r}. Download FineWeb with "
            f"`python data/cached_fineweb10B.py 8`, or write offline shards with `python data/synthetic.py "
            f"--out data/synthetic` and pass --train-files 'data/synthetic/synthetic_train_*.bin' --val-files "
            f"'data/synthetic/synthetic_val_*.bin' (relative paths are relative to the current folder)"
        )
    return files


def steps_available(files: list, batch_size: int) -> int:
    """How many step windows the shards hold, from their headers alone (token_windows' rule)."""
    return sum(max(0, -(-(read_shard_header(f) - batch_size - 1) // batch_size)) for f in files)


def token_windows(files: list, batch_size: int, seq_len: int, rows: range):
    """Yields (inputs, targets), each int32 (len(rows), seq_len): this process's virtual ranks of each step."""
    for path in files:
        tokens, pos = open_shard(path), 0
        while pos + batch_size + 1 < len(tokens):
            window = np.asarray(tokens[pos + rows.start * seq_len : pos + rows.stop * seq_len + 1], np.int32)
            inputs = np.lib.stride_tricks.sliding_window_view(window[:-1], seq_len)[::seq_len]
            targets = np.lib.stride_tricks.sliding_window_view(window[1:], seq_len)[::seq_len]
            yield np.ascontiguousarray(inputs), np.ascontiguousarray(targets)
            pos += batch_size


def prefetch(iterator, put, depth: int = 2):
    """Run `put(next(iterator))` on a background thread so the host prepares the next batch while
    the devices compute. Exceptions are re-raised in the consumer; closing the generator stops and
    joins the thread (a thread still inside JAX at interpreter exit can crash the process)."""
    q, stop = queue.Queue(maxsize=depth), threading.Event()

    def offer(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def worker():
        try:
            for item in iterator:
                if not offer(put(item)):
                    return
        except BaseException as e:  # noqa: BLE001  (handed to the consumer)
            offer(e)
        offer(StopIteration())

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if isinstance(item, StopIteration):
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


# -----------------------------------------------------------------------------
# 5 Record log: records/<UTC time>_<id>.txt, line-buffered, written by process 0 only.
# Layout: the full source of this file; a line of 100 '='; the environment; '='; the resolved
# hyperparameters as JSON; '='; then compile, step and summary lines. A complete run ends with
# `run complete`; an interrupted one with `interrupted at step N`; a failed one with `stopped: ...`.

RULE = "=" * 100  # records/logs.py has the same rule (a test checks)


class RecordLog:
    """The record file (line-buffered, never overwritten) and the console; only process 0 has one."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "x", buffering=1)  # "x": never overwrite an earlier log

    def write(self, text: str, console_note: str = "") -> None:
        """A line in the record and on the console; console_note (an ETA, say) goes to the console only."""
        print(text + console_note, flush=True)
        self.file.write(text + "\n")

    def close(self):
        self.file.close()


def val_line(step: int, N: int, val_loss: float, train_ms: float) -> str:
    return (f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{train_ms:.0f}ms "
            f"step_avg:{train_ms / step if step else float('nan'):.2f}ms")


def train_line(step: int, N: int, train_ms: float) -> str:
    return f"step:{step}/{N} train_time:{train_ms:.0f}ms step_avg:{train_ms / step:.2f}ms"


def summary_line(s: dict) -> str:
    peak = "n/a" if s["peak_memory_mib"] is None else f"{s['peak_memory_mib']:.0f}MiB"
    return (f"summary final_val_loss:{s['final_val_loss']:.4f} train_time:{s['train_time_ms']:.0f}ms "
            f"step_avg:{s['step_avg_ms']:.2f}ms tokens_per_s:{s['tokens_per_s']:.0f} compile_s:{s['compile_s']:.1f} "
            f"peak_memory:{peak}")


def new_log_path(records_dir: str) -> str:
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    return os.path.join(records_dir, f"{stamp}_{uuid.uuid4().hex[:8]}.txt")


def environment_lines() -> list:
    import jaxlib

    devices = jax.devices()
    lines = [
        f"Running Python {sys.version}",
        f"Running jax {jax.__version__} jaxlib {jaxlib.__version__} optax {optax.__version__} numpy {np.__version__}"
        f" on {platform.platform()}",
        f"Devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}) in {jax.process_count()} process(es)",
    ]
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        smi = "nvidia-smi: not available"
    return lines + [smi]


def log_header(log: RecordLog, hp: Hyperparameters, preset: str) -> None:
    log.file.write(SOURCE if SOURCE.endswith("\n") else SOURCE + "\n")
    for line in [RULE, *environment_lines(), RULE, f"Hyperparameters (preset {preset}):",
                 json.dumps(dataclasses.asdict(hp), indent=1), RULE]:
        log.file.write(line + "\n")


# -----------------------------------------------------------------------------
# 6 Training: one jitted step over a 1-D data mesh of every device. Parameters and optimizer
# state are replicated and donated; each device runs its share of the step's sequences one at a
# time (gradient accumulation), averages them, and the devices average with each other, so the
# update equals the 8-GPU reference's on any device count.


def make_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))


def sequences_per_device(hp: Hyperparameters, mesh) -> int:
    rows = hp.batch_size // hp.seq_len
    if rows % mesh.size:
        raise ConfigError(
            f"--batch-size {hp.batch_size} / --seq-len {hp.seq_len} = {rows} sequences per step cannot be split "
            f"evenly over {mesh.size} devices: choose a --seq-len that makes it a multiple of {mesh.size}"
        )
    return rows // mesh.size


def make_steps(hp: Hyperparameters, mesh, optimizer):
    """The jitted train step and validation step (not yet compiled)."""
    replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))

    def device_mean(per_sequence, init, inputs_RxT, targets_RxT):
        """Mean of per_sequence(x, y) over this device's sequences, one at a time (lax.scan, fp32
        sums), then over the devices (pmean)."""
        def add(total, xy):
            return jax.tree.map(lambda t, v: t + v.astype(F32), total, per_sequence(*xy)), None

        total, _ = jax.lax.scan(add, init, (inputs_RxT, targets_RxT))
        return jax.lax.pmean(jax.tree.map(lambda t: t / inputs_RxT.shape[0], total), "dp")

    # Training and validation share this structure (shard_map, then a scan over the device's
    # sequences) so that the two programs differ only by the gradient and the head.
    def device_grads(params, inputs_RxT, targets_RxT, window):
        def loss_and_grads(x_T, y_T):
            return jax.value_and_grad(loss_fn)(params, x_T, y_T, window, True, hp.fp8_head, hp.attention)

        zeros = (jnp.zeros((), F32), jax.tree.map(lambda p: jnp.zeros(p.shape, F32), params))
        loss, grads = device_mean(loss_and_grads, zeros, inputs_RxT, targets_RxT)
        return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)

    def device_val_loss(params, inputs_RxT, targets_RxT, window):
        def loss(x_T, y_T):
            return loss_fn(params, x_T, y_T, window, False, attention=hp.attention)

        return device_mean(loss, jnp.zeros((), F32), inputs_RxT, targets_RxT)

    # check_vma=False: the scan's carry starts as replicated zeros and becomes device-varying, which
    # the varying-axes check would reject without explicit casts; pmean makes the results replicated.
    specs = dict(mesh=mesh, in_specs=(P(), P("dp"), P("dp"), P()), check_vma=False)

    def train_step(params, opt_state, inputs, targets, window):
        loss, grads = jax.shard_map(device_grads, out_specs=(P(), P()), **specs)(params, inputs, targets, window)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return (jax.jit(train_step, donate_argnums=(0, 1), in_shardings=(replicated, replicated, by_rows, by_rows, replicated),
                    out_shardings=(replicated, replicated, replicated)),
            jax.jit(jax.shard_map(device_val_loss, out_specs=P(), **specs),
                    in_shardings=(replicated, by_rows, by_rows, replicated), out_shardings=replicated))


def enable_compile_cache(cache_dir: str) -> None:
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_persistent_cache_enable_xla_caches", "all")


class Interrupted(BaseException):
    """SIGINT/SIGTERM; a BaseException, like KeyboardInterrupt, so no library's `except Exception` eats it."""


FINEWEB_SHARD_TOKENS = 100_000_000  # tokens per train shard of data/cached_fineweb10B.py


@dataclasses.dataclass
class Inputs:
    """What a run reads, checked before anything is compiled or written."""
    train_files: list
    val_batches: list  # this process's validation windows, (inputs, targets) numpy pairs
    rows: range  # this process's virtual ranks (sequences) of each step
    per_device: int  # sequences per device per step


def check_inputs(hp: Hyperparameters, mesh, init_path: str = None, save_path: str = None) -> Inputs:
    """Raises ConfigError/DataError, naming the flag and the fix, before any work is done."""
    per_device = sequences_per_device(hp, mesh)
    per_process = per_device * len(mesh.local_devices)
    rows = range(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)
    train_files = shard_files(hp.train_files, "--train-files")
    available = steps_available(train_files, hp.batch_size)
    if available < hp.num_iterations:
        shards = math.ceil(hp.num_iterations / max(1, FINEWEB_SHARD_TOKENS // hp.batch_size))
        raise DataError(
            f"the shards matching --train-files {os.path.abspath(hp.train_files)!r} hold {available} steps of "
            f"{hp.batch_size} tokens but --num-iterations is {hp.num_iterations}: add shards (FineWeb: "
            f"`python data/cached_fineweb10B.py {shards}`) or lower --num-iterations")
    val_files = shard_files(hp.val_files, "--val-files")
    val_steps = hp.val_tokens // hp.batch_size
    val_available = steps_available(val_files, hp.batch_size)
    if val_available < val_steps:
        held = sum(read_shard_header(f) for f in val_files)
        raise DataError(
            f"the shards matching --val-files {os.path.abspath(hp.val_files)!r} hold {held} tokens: "
            f"{val_available} windows of --batch-size {hp.batch_size} (a window needs batch_size + 1 tokens "
            f"and one more left in its shard), but --val-tokens {hp.val_tokens} needs {val_steps}. "
            f"Lower --val-tokens to {val_available * hp.batch_size} or add val shards")
    val_batches = list(itertools.islice(token_windows(val_files, hp.batch_size, hp.seq_len, rows), val_steps))
    for path in train_files + val_files:  # an embedding lookup past the table would silently clamp
        tokens = open_shard(path)
        largest = int(tokens.max()) if tokens.size else -1
        if largest >= hp.vocab_size:
            raise DataError(f"{os.path.abspath(path)} holds token id {largest}, but --vocab-size is "
                            f"{hp.vocab_size}: raise --vocab-size (GPT-2 shards need {EOT + 1}) or use other shards")
    if init_path and not os.path.isfile(init_path):
        raise DataError(f"--init-weights {os.path.abspath(init_path)!r} is not a file")
    if save_path and os.path.isdir(save_path):
        raise ConfigError(f"--save-weights {os.path.abspath(save_path)!r} is a folder: give a file name (.npz)")
    for path, flag in [(hp.records_dir, "--records-dir"),  # last: the only check that creates anything
                       (os.path.dirname(os.path.abspath(save_path)) if save_path else None, "--save-weights")]:
        if path is None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
            problem = None if os.access(path, os.W_OK) else "not writable"
        except OSError as e:
            problem = e.strerror
        if problem:
            raise ConfigError(f"cannot write to {flag} folder {os.path.abspath(path)!r} ({problem}): "
                              f"choose a writable folder")
    return Inputs(train_files, val_batches, rows, per_device)


def initial_state(hp: Hyperparameters, mesh, optimizer, init_path: str = None):
    """(params, optimizer state), replicated on every device: params from init_path's weights, or seeded."""
    replicated = NamedSharding(mesh, P())
    if init_path:
        params = jax.device_put(load_weights(init_path, hp), replicated)
    else:
        params = jax.jit(init_params, static_argnums=(0, 1), out_shardings=replicated)(hp, hp.seed)
    return params, jax.jit(optimizer.init, out_shardings=replicated)(params)


def compile_steps(hp: Hyperparameters, mesh, params, opt_state, optimizer):
    """The train and validation steps, compiled ahead of time for the batch's shape and shardings."""
    train_step, val_step = make_steps(hp, mesh, optimizer)
    by_rows, replicated = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P())
    batch = jax.ShapeDtypeStruct((hp.batch_size // hp.seq_len, hp.seq_len), jnp.int32, sharding=by_rows)
    window = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return (train_step.lower(params, opt_state, batch, batch, window).compile(),
            val_step.lower(params, batch, batch, window).compile())


class TrainClock:
    """Milliseconds of training: runs while steps run, paused for validation."""

    def __init__(self):
        self.done_ms, self.since = 0.0, None

    def ms(self) -> float:
        return self.done_ms + (0.0 if self.since is None else 1000 * (time.perf_counter() - self.since))

    def run(self):
        if self.since is None:
            self.since = time.perf_counter()

    def pause(self):
        self.done_ms, self.since = self.ms(), None


def eta_note(steps_left: int, step_ms: float, validations_left: int, val_s: float) -> str:
    seconds = steps_left * step_ms / 1000 + validations_left * val_s
    return f"  (ETA {seconds / 60:.1f} min)" if seconds >= 1 else ""


def run_steps(hp: Hyperparameters, say, console, train_step, val_step, params, opt_state, batches, val_batches):
    """The schedule: N steps, validation every val_loss_every steps and at the end. Writes the step
    and val lines; returns (params, final val loss, train ms). An Interrupted raised inside gets the
    step it happened at (.step)."""
    N = hp.num_iterations
    validations = [s for s in range(N + 1) if s == N or (hp.val_loss_every and s % hp.val_loss_every == 0)]
    # Step s's loss is read only once step s + 1 is dispatched, so the devices never wait for the
    # host; its line is written then, with the clock read then.
    clock, pending, val_s, step = TrainClock(), None, 0.0, 0

    def finish(dispatched):
        finished, loss = dispatched
        loss = local_value(loss)  # waits for that step
        ms = clock.ms()
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"non-finite train loss {loss} at step {finished + 1}: usual causes are a learning rate too "
                f"high for this batch or model (--muon-lr, --embed-lr, ...) and bad data (check the shards)")
        left = [v for v in validations if v > finished]
        say(train_line(finished + 1, N, ms), eta_note(N - finished - 1, ms / (finished + 1), len(left), val_s))

    try:
        for step in range(N + 1):
            window = np.int32(window_blocks(step, hp))
            if step in validations:
                if pending:
                    finish(pending)
                    pending = None
                clock.pause()
                if step == validations[0]:
                    console(f"validating on {hp.val_tokens} tokens ...")
                t = time.perf_counter()
                losses = [val_step(params, x, y, window) for x, y in val_batches]  # all dispatched, then read
                val_loss = float(np.mean([local_value(v) for v in losses]))
                val_s = time.perf_counter() - t
                say(val_line(step, N, val_loss, clock.ms()))
                if not math.isfinite(val_loss):
                    raise FloatingPointError(f"non-finite val loss {val_loss} at step {step}: usual causes are a "
                                             f"learning rate too high and bad data")
            if step == N:
                return params, val_loss, clock.ms()
            x, y = next(batches)
            clock.run()
            params, opt_state, loss = train_step(params, opt_state, x, y, window)
            if pending:
                finish(pending)
            pending = (step, loss)
    except Interrupted as e:
        e.step = step
        raise


def train(hp: Hyperparameters, preset: str, mesh, init_path: str = None, save_path: str = None) -> dict:
    """Run the whole speedrun; returns the summary. Bad input raises ConfigError/DataError before
    anything is written; the record log is opened once the steps are compiled."""
    main_process = jax.process_index() == 0

    def console(text):
        if main_process:
            print(text, flush=True)

    def interrupt(signum, frame):  # runs in the main thread, between Python bytecodes
        raise Interrupted(signal.Signals(signum).name)

    previous, log, batches, trained = {}, None, None, False

    def say(text, console_note=""):
        if log:
            log.write(text, console_note)

    try:
        previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        console("checking shards and flags ...")
        inputs = check_inputs(hp, mesh, init_path, save_path)
        by_rows = NamedSharding(mesh, P("dp"))
        optimizer = make_optimizer(hp, mesh)
        params, opt_state = initial_state(hp, mesh, optimizer, init_path)
        console(f"compiling the train and validation steps (persistent cache: {hp.compile_cache_dir or 'off'}) ...")
        t0 = time.perf_counter()
        train_step, val_step = compile_steps(hp, mesh, params, opt_state, optimizer)
        compile_s = time.perf_counter() - t0

        if main_process:
            log = RecordLog(new_log_path(hp.records_dir))
            print(f"record log: {os.path.abspath(log.path)}", flush=True)  # records/attempt.py finds the log by it
            log_header(log, hp, preset)
        say(f"preset {preset}: {hp.num_iterations} steps x {hp.batch_size} tokens, {mesh.size} device(s), "
            f"{inputs.per_device} sequence(s) of {hp.seq_len} per device per step; log {log.path if log else '-'}")
        if init_path:
            say(f"initial weights: {os.path.abspath(init_path)}")
        say(f"compile: {compile_s:.1f}s for the train and validation steps (persistent cache: "
            f"{hp.compile_cache_dir or 'off'})")

        def put(batch):
            return tuple(jax.make_array_from_process_local_data(by_rows, x) for x in batch)

        val_batches = [put(b) for b in inputs.val_batches]
        batches = prefetch(token_windows(inputs.train_files, hp.batch_size, hp.seq_len, inputs.rows), put)
        params, val_loss, train_ms = run_steps(hp, say, console, train_step, val_step, params, opt_state, batches,
                                               val_batches)
        trained = True
        stats = jax.local_devices()[0].memory_stats() or {}
        summary = {
            "final_val_loss": val_loss,
            "train_time_ms": train_ms,
            "step_avg_ms": train_ms / hp.num_iterations,
            "tokens_per_s": hp.num_iterations * hp.batch_size / (train_ms / 1000),
            "compile_s": compile_s,
            "peak_memory_mib": stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None,
            "log": log.path if log else None,
        }
        say(summary_line(summary))
        if save_path and main_process:
            save_weights(params, save_path)
            say(f"weights saved: {os.path.abspath(save_path)}")
        say("run complete")
    except Interrupted as e:
        if log:
            say(f"interrupted at step {getattr(e, 'step', hp.num_iterations if trained else 0)} ({e})")
        else:
            console(f"interrupted ({e}) before training started; no record log was written")
        raise
    except FloatingPointError as e:
        say(f"stopped: {e}")
        raise
    except Exception as e:  # a bug or a device error: the log says so, the traceback goes on
        say(f"stopped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        for s in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        try:
            if batches is not None:
                batches.close()
        finally:
            if log:
                log.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
    return summary


def local_value(x) -> float:
    """A replicated scalar's value from this process's own copy (other processes' are not addressable)."""
    return float(x.addressable_data(0))


# -----------------------------------------------------------------------------
# Several processes or hosts: jax.distributed with the coordinator given by flags or JAX_*
# environment variables, or detected from SLURM / Open MPI. One process per host (all its GPUs) or
# one per GPU both work: the mesh spans every process's devices, and each process loads only its
# own virtual ranks.


def distributed_settings(args):
    """Keyword arguments for jax.distributed.initialize, or None for a plain single-process run."""
    given = {
        "coordinator_address": args.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS"),
        "num_processes": args.num_processes or os.environ.get("JAX_NUM_PROCESSES"),
        "process_id": args.process_id if args.process_id is not None else os.environ.get("JAX_PROCESS_ID"),
    }
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ConfigError("a multi-process run needs --coordinator-address, --num-processes and --process-id "
                             f"(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); missing: {missing}")
        try:
            given["num_processes"], given["process_id"] = int(given["num_processes"]), int(given["process_id"])
        except ValueError:
            raise ConfigError(f"the number of processes and the process id must be integers, got "
                              f"{given['num_processes']!r} and {given['process_id']!r}") from None
        return {**given, "heartbeat_timeout_seconds": args.heartbeat_timeout}
    if int(os.environ.get("SLURM_NTASKS", 1)) > 1 or int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1)) > 1:
        return {"heartbeat_timeout_seconds": args.heartbeat_timeout}  # JAX reads the cluster's variables
    return None


def start_distributed(settings) -> None:
    if settings is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes (tests); GPUs use NCCL
    jax.distributed.initialize(**settings)


def assert_same_everywhere(hp: Hyperparameters, preset: str) -> None:
    """Every process must train the same configuration (else the compiled programs differ and hang)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        digest = np.frombuffer(uuid.uuid5(uuid.NAMESPACE_OID, preset + repr(hp)).bytes, np.uint8)
        multihost_utils.assert_equal(digest, "processes were started with different hyperparameters")


# -----------------------------------------------------------------------------
# Command line: every Hyperparameters field is a flag (--num-iterations 200, --train-files ...).


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Train the record-20 GPT (modded-nanogpt speedrun) in JAX on all local devices.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="named configuration; default: record when a GPU is present, else cpu")
    parser.add_argument("--init-weights", metavar="PATH", help="start from these weights (.npz, as --save-weights "
                        "writes them) instead of the seed's initialisation")
    parser.add_argument("--save-weights", metavar="PATH", help="after the run, save the trained weights to PATH "
                        "(.npz keyed by the PyTorch state-dict names)")
    launch = parser.add_argument_group("multi-process launch (also JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                                       "JAX_PROCESS_ID; SLURM and Open MPI are detected)")
    launch.add_argument("--coordinator-address", help="host:port of process 0")
    launch.add_argument("--num-processes", type=int)
    launch.add_argument("--process-id", type=int)
    launch.add_argument("--heartbeat-timeout", type=int, default=100,
                        help="seconds after which a silent process counts as dead and the others stop (100)")
    hyper = parser.add_argument_group("hyperparameters (defaults: those of the chosen preset)")
    for field in dataclasses.fields(Hyperparameters):
        flag = "--" + field.name.replace("_", "-")
        defaults = f"(record: {getattr(PRESETS['record'], field.name)}, cpu: {getattr(PRESETS['cpu'], field.name)})"
        if field.type in (bool, "bool"):
            hyper.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=defaults)
        else:
            hyper.add_argument(flag, dest=field.name, type=field.type, default=None, help=defaults,
                               choices=("xla", "pallas") if field.name == "attention" else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = (" (they look like shard files: the shell expanded an unquoted glob; quote it, e.g. "
                "--train-files 'data/fineweb10B/fineweb_train_*.bin')") if unknown[0].endswith(".bin") else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Hyperparameters)
                 if getattr(args, f.name) is not None}
    return args, overrides


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    try:
        start_distributed(distributed_settings(args))
        preset = args.preset or ("record" if jax.default_backend() == "gpu" else "cpu")
        hp = dataclasses.replace(PRESETS[preset], **overrides)
        if args.preset is None and jax.process_index() == 0:
            print(f"preset {preset} (chosen because the JAX backend is {jax.default_backend()}; "
                  f"pass --preset to choose)", flush=True)
        enable_compile_cache(hp.compile_cache_dir)
        assert_same_everywhere(hp, preset)
        train(hp, preset, make_mesh(), args.init_weights, args.save_weights)
    except (ConfigError, DataError) as e:  # bad input: said in one line, nothing written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        return 143 if str(e) == "SIGTERM" else 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
