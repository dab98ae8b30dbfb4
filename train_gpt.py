"""The modded-nanogpt speedrun's record 89 (PyTorch, KellerJordan/modded-nanogpt f411b3d3) in JAX.

Trains the record-89 GPT (11 layers, paired-head and long-window attention with YaRN, value and bigram
embeddings, MUDD dense connections and gates, DC, XSA, ReLU² MLP with FP8, FP8 softcapped head with
multi-token and prefix-token losses) with NorMuon + Adam on FineWeb, on any number of devices with the
8-GPU run's math. Read top to bottom: 1 hyperparameters and schedule, 2 model, 3 optimizer, 4 data,
5 training step, 6 record log, 7 training loop, 8 several processes, 9 command line.
Importing this file has no side effects; `python train_gpt.py --help` lists every option.
"""

import argparse
import dataclasses
import difflib
import faulthandler
import glob
import json
import math
import os
import pathlib
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import pallas as pl
from jax.experimental.pallas import fuser  # noqa: F401  (jax 0.11: see the Pallas section)
from jax.experimental.pallas import triton as pltriton
from jax.sharding import NamedSharding, PartitionSpec as P

SOURCE = pathlib.Path(__file__).read_text()  # read at start-up: the record log embeds the code that runs


# -----------------------------------------------------------------------------
# 1 Hyperparameters and schedule


class ConfigError(ValueError):
    """A flag or a combination of flags that cannot run; the message names the flag and the fix."""


class DataError(ValueError):
    """Shards, weights or paths that cannot be used; the message names the file (absolute path) and the fix."""


BOS = 50256  # <|endoftext|>: starts every document
BLOCK = 128  # window sizes are counted in blocks of this many tokens
NUM_LAYERS = 11  # the layer layout below (paired, XSA, gates, MUDD, DC) is written for 11 layers of 6 heads
NUM_HEADS = 6
RANKS = 8  # the record's GPUs: every step's batch is their 8 chunks, whatever the device count
E4M3_MAX = 448.0
GEMM_IMPLEMENTATIONS = ("xla", "pallas")  # --mlp, --head: the FP8 GEMMs' epilogues and passes in XLA or Pallas kernels
AUTO_FIELDS = ("attention", "dc", "mlp", "head")  # flags whose default, auto, picks by backend (auto_implementation)
# auto on GPUs: the Pallas kernels a GPU has checked and timed. The head's, rewritten, wrote outside their
# e5m2 gradient's array on their first GPU run (2026-11-27; fixed, not yet run on a GPU:
# _triton_offsets_of_arrays_past_2_31_elements_in_64_bits), and the DC correction's (2026-11-28) have never
# run on one: XLA's until the GPU lane's case and a short run pass with them.
AUTO_ON_GPU = {"attention": "pallas", "dc": "xla", "mlp": "pallas", "head": "xla"}
F32_EPS = float(np.finfo(np.float32).eps)  # torch's rms_norm eps for fp32 and bf16 inputs alike
COMPILE_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "train_gpt_jax")  # --compile-cache-dir's default


@dataclasses.dataclass(frozen=True)
class Stage:
    """One part of the schedule (the reference's TrainingStage); weights interpolate linearly within it."""
    batch_size: int  # tokens per optimizer step over all 8 reference ranks
    max_seq_len: int  # documents are cut at this length
    windows: tuple  # (short, long) attention windows in BLOCKs
    lr_mul: float
    mtp_start: tuple  # multi-token-prediction weights at the stage's first step ...
    mtp_end: tuple  # ... and at its end
    prefix_start: float = 0.0
    prefix_end: float = 0.0


RECORD_STAGES = (  # three thirds of the scheduled steps, then the extension (stages counted from 0)
    Stage(8 * 2048 * 8, 896, (1, 3), 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, 0.25),
    Stage(16 * 2048 * 8, 2048, (3, 7), 1.52, (1.0, 0.5), (1.0, 0.0), 0.25, 0.0),
    Stage(24 * 2048 * 8, 2048, (5, 11), 1.73, (1.0,), (1.0,)),
    Stage(24 * 2048 * 8, 2048, (6, 13), 1.0, (1.0,), (1.0,)),  # extension: lr stays at the cooldown's end
)


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"  # the train shards, a glob, read in sorted order
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"  # the validation shards, a glob
    val_tokens: int = 10_485_760  # the tokens each validation reads (from the start of the val shards)
    val_batch_size: int = 4 * 64 * 1024 * 8  # validation tokens per step over the 8 reference ranks
    bos_id: int = BOS  # the token that starts every document (<|endoftext|> of GPT-2 shards)
    # model (layers and heads are fixed: NUM_LAYERS, NUM_HEADS)
    vocab_size: int = 50257  # token ids are below it; the head pads it to a multiple of 128 (50304)
    head_dim: int = 128  # model_dim = 6 x head_dim
    attention: str = "xla"  # the windowed attention: "xla" (pure JAX) or "pallas" (Triton kernels; interpreted on CPU)
    dc: str = "xla"  # layer 10's DC correction: "xla" (pure JAX) or "pallas" (Triton kernels)
    mlp: str = "xla"  # the FP8 MLP's up projection and dpre: "xla" (XLA's GEMMs and passes) or "pallas" (fused epilogues)
    head: str = "xla"  # the FP8 head's softcap, normaliser and gradient after cuBLAS's GEMM: "xla" or "pallas"
    # (the command line's default for these four, auto, picks by backend: auto_implementation)
    bigram_vocab_size: int = 50304 * 15 // 2  # the bigram embedding's hash buckets; the last is position 0's
    bigram_sign_rows: int = 8192  # rows of the random +-1 table the bigram embedding is multiplied by
    # schedule
    stages: tuple = RECORD_STAGES
    num_scheduled_iterations: int = 1270  # the three stages' steps (thirds), the lr schedule's length
    num_extension_iterations: int = 15  # then these steps (the extension stage), the lr at its final value
    cooldown_frac: float = 0.6  # the lr multiplier falls linearly to final_lr_mul over this last part
    final_lr_mul: float = 0.15  # the lr multiplier at the end of the scheduled steps
    split_embed_stage: int = 2  # embed and lm_head are untied from this stage's first odd step
    final_window_long: int = 20  # long window (blocks) of the last validation, without a YaRN update
    muon_momentum_warmup_steps: int = 300  # NorMuon's momentum rises from 0.85 to 0.95 over these first steps
    muon_momentum_cooldown_steps: int = 50  # NorMuon's momentum falls back to 0.85 over these last steps
    fp8_bootstrap_steps: int = 16  # the down projection's weight scales are re-measured before these steps
    # optimizer
    adam_lr: float = 0.008  # Adam's lr (tables, head, gates, scalars) x PARAM_TABLE's and the stage's lr_mul
    adam_eps: float = 1e-10  # Adam's epsilon
    adam_wd: float = 0.005  # Adam's weight decay, times PARAM_TABLE's wd_mul
    muon_lr: float = 0.023  # NorMuon's lr (the attention and MLP banks) x the stage's lr_mul
    muon_beta2: float = 0.9  # NorMuon's decay of its second-moment estimate
    muon_wd: float = 1.2  # NorMuon's cautious weight decay
    # evaluation, logging, compilation
    val_loss_every: int = 250  # validate every this many steps (0: only at the end)
    intermediate_val_tokens: int = 0  # validations before the last read only the first this many (0: --val-tokens)
    seed: int = 0  # of the initial weights (the data's order does not depend on it)
    records_dir: str = "records"  # the folder of the run's log
    compile_cache_dir: str = COMPILE_CACHE  # XLA's compiled programs, kept for later runs ("" = off)

    def __post_init__(self):
        problems = [message for ok, message in [
            (self.head_dim >= 16 and self.head_dim % 8 == 0,
             f"--head-dim {self.head_dim} must be a multiple of 8, at least 16 (rotary uses head_dim/4 pairs)"),
            (self.num_scheduled_iterations >= 3,
             f"--num-scheduled-iterations {self.num_scheduled_iterations} must be at least 3 (three stages)"),
            (self.num_extension_iterations >= 0,
             f"--num-extension-iterations {self.num_extension_iterations} must be >= 0"),
            (0 < self.cooldown_frac <= 1 and self.cooldown_start < self.num_scheduled_iterations,
             f"--cooldown-frac {self.cooldown_frac} must be in (0, 1] and cover at least one of the "
             f"{self.num_scheduled_iterations} scheduled steps"),
            (len(self.stages) == 4, "four stages: three scheduled thirds and the extension"),
            (self.attention in ("xla", "pallas"), f"--attention {self.attention!r}: choose xla or pallas"),
            (self.dc in ("xla", "pallas"), f"--dc {self.dc!r}: choose xla or pallas"),
            (self.mlp in GEMM_IMPLEMENTATIONS, f"--mlp {self.mlp!r}: choose xla or pallas"),
            (self.head in GEMM_IMPLEMENTATIONS, f"--head {self.head!r}: choose xla or pallas"),
            (0 <= self.bos_id < self.vocab_size,
             f"--bos-id {self.bos_id} must be a token id below --vocab-size {self.vocab_size}"),
            *[(s.batch_size > 0 and s.batch_size % (RANKS * BLOCK) == 0 and s.max_seq_len > 0,
               f"stage {k}: batch {s.batch_size} must split into 8 ranks of a multiple of {BLOCK} tokens "
               f"(attention's blocks): a positive multiple of {RANKS * BLOCK}")
              for k, s in enumerate(self.stages)],
            (self.val_batch_size % (RANKS * BLOCK) == 0 and self.val_batch_size > 0 and self.val_tokens > 0
             and self.val_tokens % self.val_batch_size == 0,
             f"--val-tokens {self.val_tokens} must be a positive multiple of --val-batch-size {self.val_batch_size}, "
             f"itself a positive multiple of {RANKS * BLOCK} (8 ranks of {BLOCK}-token blocks)"),
            (self.vocab_size > 0, f"--vocab-size {self.vocab_size} must be positive"),
            (self.bigram_vocab_size >= 2 and self.bigram_sign_rows >= 1,
             f"--bigram-vocab-size {self.bigram_vocab_size} must be at least 2 and --bigram-sign-rows "
             f"{self.bigram_sign_rows} at least 1"),
            (0 <= self.seed < 2**32, f"--seed {self.seed} must be in [0, 2**32)"),
            (self.val_loss_every >= 0, f"--val-loss-every {self.val_loss_every} must be >= 0 (0: only at the end)"),
            (self.intermediate_val_tokens == 0 or (self.intermediate_val_tokens % self.val_batch_size == 0
                                                   and 0 < self.intermediate_val_tokens <= self.val_tokens),
             f"--intermediate-val-tokens {self.intermediate_val_tokens} must be 0 (all --val-tokens) or a positive "
             f"multiple of --val-batch-size {self.val_batch_size}, at most --val-tokens {self.val_tokens}"),
            *[(math.isfinite(v) and v > 0, f"--{name.replace('_', '-')} {v} must be a positive number")
              for name, v in [("adam_lr", self.adam_lr), ("muon_lr", self.muon_lr), ("adam_eps", self.adam_eps)]],
            *[(math.isfinite(v) and v >= 0, f"--{name.replace('_', '-')} {v} must be a number >= 0")
              for name, v in [("adam_wd", self.adam_wd), ("muon_wd", self.muon_wd), ("final_lr_mul", self.final_lr_mul)]],
            (0 <= self.muon_beta2 < 1, f"--muon-beta2 {self.muon_beta2} must be in [0, 1)"),
            *[(v >= 0, f"--{name.replace('_', '-')} {v} must be >= 0")
              for name, v in [("muon_momentum_warmup_steps", self.muon_momentum_warmup_steps),
                              ("muon_momentum_cooldown_steps", self.muon_momentum_cooldown_steps),
                              ("fp8_bootstrap_steps", self.fp8_bootstrap_steps)]],
            (0 <= self.split_embed_stage <= 3, f"--split-embed-stage {self.split_embed_stage} must be a stage, 0-3"),
            (self.final_window_long >= 1, f"--final-window-long {self.final_window_long} must be >= 1 (blocks)"),
            *[(bool(v), f"--{name.replace('_', '-')} must not be empty")
              for name, v in [("train_files", self.train_files), ("val_files", self.val_files)]],
        ] if not ok]
        if problems:
            raise ConfigError("bad hyperparameters:\n  " + "\n  ".join(problems))

    @property
    def model_dim(self) -> int:
        return NUM_HEADS * self.head_dim

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // 128) * 128

    @property
    def cooldown_start(self) -> int:
        """The first step of the lr cool-down (the reference's expression)."""
        return int(self.num_scheduled_iterations * (1 - self.cooldown_frac))

    @property
    def total_steps(self) -> int:
        return self.num_scheduled_iterations + self.num_extension_iterations


# `cpu`: the same topology for 2 CPU cores, passing every transition of the schedule in a few minutes:
# three stage changes with YaRN, the embedding split, the extension, the final windows and the end
# of the FP8 bootstrap. What shrinks: head size 16 (model dim 96), the bigram table, the batches (8
# chunks of 256 / 512 / 768 tokens), documents cut at 256 then 512 tokens, 24 + 3 steps and the
# step constants that count absolute steps (momentum warm-up 300 -> 8 and cool-down 50 -> 4, FP8
# bootstrap 16 -> 4), validation on 8 x 1024 tokens every 8 steps.
CPU_STAGES = tuple(dataclasses.replace(s, batch_size=8 * 256 * k, max_seq_len=256 if k == 1 else 512)
                   for s, k in zip(RECORD_STAGES, (1, 2, 3, 3)))
PRESETS = {
    "record": Hyperparameters(),
    "cpu": Hyperparameters(head_dim=16, bigram_vocab_size=8 * 1024, stages=CPU_STAGES, num_scheduled_iterations=24,
                           num_extension_iterations=3, muon_momentum_warmup_steps=8, muon_momentum_cooldown_steps=4,
                           fp8_bootstrap_steps=4, val_batch_size=8 * 1024, val_tokens=8 * 1024, val_loss_every=8),
}


# The schedule, as the reference's TrainingSchedule computes it (same float expressions, so the same
# boundaries, weights and lr multipliers bit for bit).

def stage_bounds(hp: Hyperparameters) -> list:
    """[(first, end)] of each stage: thirds of the scheduled steps (rounded), then the extension."""
    n, acc, ends = hp.num_scheduled_iterations, 0.0, [0]
    for _ in range(2):
        acc += 1 / 3
        ends.append(round(acc * n))
    ends += [n, hp.total_steps]
    return list(zip(ends[:-1], ends[1:]))


def stage_of(step: int, hp: Hyperparameters) -> tuple:
    """(stage index, fraction of the stage done) at a step; past the end, the extension's end."""
    for k, (first, end) in enumerate(stage_bounds(hp)):
        if step < end:
            return k, (step - first) / (end - first)
    return len(hp.stages) - 1, 1.0


def split_step(hp: Hyperparameters) -> int:
    """The first odd step of the split stage: embed and lm_head are tied up to and including it."""
    return stage_bounds(hp)[hp.split_embed_stage][0] | 1


def loss_weights(step: int, hp: Hyperparameters) -> tuple:
    """(MTP weights as float32, prefix weight as float32) at a step, interpolated within the stage."""
    k, t = stage_of(step, hp)
    s = hp.stages[k]
    mtp = [a + (b - a) * t for a, b in zip(s.mtp_start, s.mtp_end)]
    return np.array(mtp, np.float32), np.float32(s.prefix_start + (s.prefix_end - s.prefix_start) * t)


def lr_mul(step: int, hp: Hyperparameters) -> float:
    """The stage's lr multiplier, falling linearly to final_lr_mul from the cooldown's start."""
    k, _ = stage_of(step, hp)
    lr = hp.stages[k].lr_mul
    cd_start = hp.cooldown_start
    if step >= cd_start:
        t = min(1.0, (step - cd_start) / (hp.num_scheduled_iterations - cd_start))
        lr = lr * (1 - t) + hp.final_lr_mul * t
    return lr


def muon_momentum(step: int, hp: Hyperparameters) -> float:
    lo, hi = 0.85, 0.95
    cd_start = hp.total_steps - hp.muon_momentum_cooldown_steps
    if step < hp.muon_momentum_warmup_steps:
        return lo + step / hp.muon_momentum_warmup_steps * (hi - lo)
    if step > cd_start:
        return hi - (step - cd_start) / hp.muon_momentum_cooldown_steps * (hi - lo)
    return hi


def windows(step: int, hp: Hyperparameters, final_val: bool = False) -> tuple:
    """(short, long) attention windows in tokens at a step; the last validation widens the long one."""
    short, long = hp.stages[stage_of(step, hp)[0]].windows
    return short * BLOCK, (hp.final_window_long if final_val else long) * BLOCK


# -----------------------------------------------------------------------------
# 2 Model: a pure function of a flat dict of arrays keyed by the PyTorch reference's names.
#
# Shape suffixes: T tokens of a sequence, D model dim, H heads (6), K head dim, V vocabulary rows
# (padded), N 128-token blocks, B tokens per block, S the paired layers' doubled sequence (2T),
# G MUDD gate coefficients. Layer layout of record 89 (11 layers, 0-based):
#   attention everywhere but layer 6 (which adds the skip from layer 3); layers 8-10 attend over
#   norm(stream after layer 7); paired heads on 0, 2, 5, 9; long windows (and the key offset) on 3
#   and 10; value embeddings on 1, 2, 8, 9, 10; learnable XSA on 1, 3, 4, 7; output gates on 3, 10;
#   DC on 10; MUDD dense mixes at layer 10 and after the loop.


BF16, F32 = jnp.bfloat16, jnp.float32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# XLA's GPU compiler may drop a rounding to bf16 whose value is read back in fp32 ("excess precision"):
# compiled for an H100 (2026-11-27), 22 of the train program's kernels stored the residual stream, its
# gradient, the MLP's output and the attention's values in fp32, unrounded, where the code (and the
# reference) stores bf16. So the programs are compiled to round where the code rounds (XLA:CPU drops
# some such roundings all the same: the pieces that must round there do it with _bf16_rounded, whose
# widened bits no compiler drops, or with reduce_precision).
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}

PAIRED_LAYERS = (0, 2, 5, 9)
LONG_WINDOW_LAYERS = (3, 10)
DC_LAYER = 10
VE_LAYERS = (1, 2, 8, 9, 10)  # value-embedding table k serves VE_LAYERS[k]
SKIP_FROM, SKIP_TO = 3, 6
ATTN_LAYERS = tuple(i for i in range(NUM_LAYERS) if i != SKIP_TO)
MUDD_DIM = 64
MUDD_SCALE = 0.1  # MUDD outputs are (W2·gelu(W1·x) + b2)·0.1
DC_WINDOW = 112  # DC mixes attention probabilities over the last 112 tokens (self included)
SMEAR_DIMS = 12
VE_GATE_DIMS = 6  # the value-embedding gate reads 6 dims of x and 6 of the value embedding
LM_HEAD_X_S, LM_HEAD_W_S, LM_HEAD_GRAD_S = 100 / 448, 1.6 / 448, 0.75 / 448  # FP8 head scales (grad scale 1)
SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5  # logits z = 23·sigmoid((u + 5) / 7.5)
MLP_ACT_HEADROOM, MLP_WEIGHT_HEADROOM = 1.80, 1.12  # delayed FP8 scales of the down projection
BIGRAM_HASH = (36313, 27191)

# MUDD gate layouts: which coefficient of the gate networks' outputs drives what.
PRE_GATE = 26  # from x0:    XSA alphas of layers 1, 3 (6 each), gate of layer 3 (6), x0/bigram of 0..3 (2 each)
POST_GATE = 41  # at layer 4: XSA of 4, 7, gate of 10, x0/bigram of 4, 5, 7, 8, 9, skip (1), DC w1, w2 (6 each)
PRE_INJECT_LAYERS, POST_INJECT_LAYERS = (0, 1, 2, 3), (4, 5, 7, 8, 9)
MUDD_LAYER10, MUDD_FINAL = 14, 5  # coefficients of the two MUDD mixes


def num_qk_matrices() -> int:
    return len(ATTN_LAYERS) * 2 * (NUM_HEADS // 2)  # one (2K, D) matrix per head pair of Q and of K


def param_shapes(hp: Hyperparameters) -> dict:
    """name -> (shape, dtype) of every parameter, in the reference's named_parameters() order."""
    D, V, K = hp.model_dim, hp.padded_vocab, hp.head_dim
    n_qk, n_vo = num_qk_matrices(), 2 * len(ATTN_LAYERS)
    pad8 = lambda n: -(-n // 8) * 8  # banks padded to a multiple of the 8 reference ranks
    return {
        "lm_head.weight": ((D, V), BF16),
        "embed.weight": ((V, D), BF16),
        "value_embeds": ((len(VE_LAYERS) * V, D), BF16),
        "ve_gate_bank": ((len(VE_LAYERS), NUM_HEADS, 2 * VE_GATE_DIMS), BF16),
        "qk_bank": ((pad8(n_qk), 2 * K, D), BF16),
        "vo_bank": ((pad8(n_vo), D, D), BF16),
        "mlp_bank": ((NUM_LAYERS + 1, 2, 4 * D, D), BF16),  # [c_fc, c_proj] per layer, one padding layer
        "smear_gate.weight": ((1, SMEAR_DIMS), BF16),
        "bigram_embed.weight": ((hp.bigram_vocab_size, D), BF16),
        "post_lambdas": ((NUM_LAYERS, 2), F32),
        "resid_lambdas": ((NUM_LAYERS, 2), F32),
        "scalars": ((pad8(2 * NUM_LAYERS + 2), ), F32),  # sa lambdas (2 per layer), smear, skip, padding
        "mudd_w1": ((2, MUDD_DIM, D), BF16),
        "mudd_w2": ((2, MUDD_LAYER10, MUDD_DIM), BF16),
        "mudd_b2": ((2, MUDD_LAYER10), BF16),
        "_mudd_gate_scale": ((), F32),
        "mudd_gate_w1": ((2, MUDD_DIM, D), BF16),
        "mudd_gate_w2": ((2, POST_GATE, MUDD_DIM), BF16),
        "mudd_gate_b2": ((2, POST_GATE), BF16),
    }


def buffer_shapes(hp: Hyperparameters) -> dict:
    """The reference's persistent buffers that are state, not parameters."""
    return {
        "bigram_sign_table": ((hp.bigram_sign_rows, hp.model_dim), BF16),
        "_mlp_down_act_scales": ((NUM_LAYERS + 1,), F32),
        "_mlp_down_proj_scales": ((NUM_LAYERS + 1,), F32),
        "_mlp_down_proj_next_scales": ((NUM_LAYERS + 1,), F32),
    }


def mudd_bias_init():
    """The MUDD biases in the pre-scaled domain (effective value = bias·0.1), as the reference sets them."""
    b = np.zeros((2, MUDD_LAYER10), np.float32)
    b[0, 6:8] = 2.0 / MUDD_SCALE  # layer 10's value-embedding gates start at 2 (the others' 2·sigmoid max)
    b[0, 8], b[0, 9] = 1.1**0.5 / MUDD_SCALE, 1.0 / MUDD_SCALE  # layer 10's attention resid / post lambdas
    b[0, 11] = 0.05 / MUDD_SCALE  # layer 10's bigram injection (x0 injection starts at 0)
    b[0, 12], b[0, 13] = 1.1**0.5 / MUDD_SCALE, 1.0 / MUDD_SCALE  # layer 10's MLP resid / post lambdas
    b[1, 1] = -0.5 / MUDD_SCALE  # after the loop: -0.5·(stream after layer 7), the former "backout"
    g = np.zeros((2, POST_GATE), np.float32)
    for k in range(2):
        g[k, 12:18] = 0.25 / MUDD_SCALE  # attention output gates of layers 3 (pre) and 10 (post)
    g[0, 19:26:2] = 0.05 / MUDD_SCALE  # bigram injections of layers 0..3
    g[1, 19:28:2] = 0.05 / MUDD_SCALE  # ... and of layers 4, 5, 7, 8, 9
    g[1, 28] = 0.5 / MUDD_SCALE  # skip gate
    g[1, 29:35] = 1.0 / MUDD_SCALE  # DC w1 starts at 1
    return b, g


def init_params(hp: Hyperparameters, seed: int) -> dict:
    """What the reference draws at init (its distributions, scales and zero pattern) from a JAX seed,
    plus the state buffers: a flat dict by the reference's names."""
    return _draw_params(hp, jax.random.PRNGKey(seed))


@partial(jax.jit, static_argnums=0)
def _draw_params(hp: Hyperparameters, key) -> dict:
    D, V = hp.model_dim, hp.padded_vocab
    shapes = param_shapes(hp)
    keys = iter(jax.random.split(key, 16))
    bound = 3**0.5 * 0.5 * D**-0.5  # uniform with std 0.5/sqrt(D)
    kaiming = D**-0.5  # kaiming_uniform(a=sqrt(5)) bound for fan-in D

    def uniform(shape, b):
        return jax.random.uniform(next(keys), shape, F32, -b, b)

    n_qk, n_vo = num_qk_matrices(), 2 * len(ATTN_LAYERS)
    qk = jnp.zeros(shapes["qk_bank"][0], F32).at[:n_qk].set(uniform((n_qk, 2 * hp.head_dim, D), bound))
    vo = jnp.zeros(shapes["vo_bank"][0], F32).at[:n_vo].set(uniform((n_vo, D, D), bound))
    mlp = jnp.zeros(shapes["mlp_bank"][0], F32).at[:, 0].set(uniform((NUM_LAYERS + 1, 4 * D, D), bound))
    lm_head = (0.005 * jax.random.normal(next(keys), (D, V), F32)).astype(BF16)
    mudd_b2, gate_b2 = mudd_bias_init()
    sa = np.tile(np.array([0.5, 1.0], np.float32), NUM_LAYERS)
    scalars = np.ones(shapes["scalars"][0], np.float32)
    scalars[:2 * NUM_LAYERS + 2] = np.concatenate([sa, [0.0, -1.5]])  # smear lambda 0, skip lambda -1.5
    params = {
        "lm_head.weight": lm_head,
        "embed.weight": lm_head.T,  # tied at init
        "value_embeds": 0.01 * jax.random.normal(next(keys), shapes["value_embeds"][0], F32),
        "ve_gate_bank": jnp.zeros(shapes["ve_gate_bank"][0]),
        "qk_bank": qk,
        "vo_bank": vo,
        "mlp_bank": mlp,
        "smear_gate.weight": jnp.zeros(shapes["smear_gate.weight"][0]),
        "bigram_embed.weight": jnp.zeros(shapes["bigram_embed.weight"][0]),
        "post_lambdas": jnp.ones((NUM_LAYERS, 2)),
        "resid_lambdas": jnp.full((NUM_LAYERS, 2), 1.1**0.5),
        "scalars": jnp.asarray(scalars),
        "mudd_w1": uniform((2, MUDD_DIM, D), kaiming),
        "mudd_w2": jnp.zeros(shapes["mudd_w2"][0]),
        "mudd_b2": jnp.asarray(mudd_b2),
        "_mudd_gate_scale": jnp.asarray(0.1),
        "mudd_gate_w1": uniform((2, MUDD_DIM, D), kaiming),
        "mudd_gate_w2": jnp.zeros(shapes["mudd_gate_w2"][0]),
        "mudd_gate_b2": jnp.asarray(gate_b2),
    }
    params = {k: params[k].astype(dtype) for k, (_, dtype) in shapes.items()}
    signs = jnp.sign(jax.random.normal(next(keys), (hp.bigram_sign_rows, D), F32))
    ones = jnp.ones((NUM_LAYERS + 1,), F32)
    return {**params, "bigram_sign_table": signs.astype(BF16), "_mlp_down_act_scales": ones,
            "_mlp_down_proj_scales": ones, "_mlp_down_proj_next_scales": ones}


# --- pieces -------------------------------------------------------------------


def rms_norm(x, eps=F32_EPS):
    """torch's F.rms_norm without weight: fp32 math, rounded once to x's dtype."""
    x32 = x.astype(F32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def matmul(a, b):
    """a @ b as torch's matmul in a's dtype: fp32 accumulation, the product rounded once to a's dtype as
    the dot's own result. So on GPUs cuBLAS writes the bf16 product, not an fp32 one (twice the bytes)
    that another kernel reads back to round; the barrier keeps the rounding where jax 0.10.2's XLA:CPU
    would compute the product in fp32 and hand it on unrounded (excess precision)."""
    return jax.lax.optimization_barrier(jnp.matmul(a, b, preferred_element_type=a.dtype))


@jax.custom_vjp
def linear(x, w_OxI):
    """F.linear: x @ Wᵀ in x's dtype with fp32 accumulation."""
    return matmul(x, w_OxI.astype(x.dtype).T)


def _linear_bwd(res, g):
    """The backward's GEMMs in x's dtype with fp32 accumulation, as torch's. (Autodiff would run them
    on fp32 copies, the same values through fp32 GEMMs: TF32 at best on a GPU, half bf16's rate.)"""
    x, w_OxI = res
    g_NxO, x_NxI = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    dx = matmul(g, w_OxI.astype(x.dtype))
    dw = matmul(g_NxO.T, x_NxI).astype(w_OxI.dtype)
    return dx, dw


linear.defvjp(lambda x, w_OxI: (linear(x, w_OxI), (x, w_OxI)), _linear_bwd)


@jax.custom_vjp
def embedding(table_VxD, ids_T):
    """table[ids] as torch's nn.Embedding: its backward sums each row's cotangents in fp32 and rounds
    once to the table's dtype (torch's decomposition and CUDA kernel alike). Autodiff's bf16
    scatter-add would stall on a frequent token: 4,096 cotangents near 1 sum to about 1,000 in bf16."""
    return table_VxD[ids_T]


def _embedding_bwd(res, g):
    table, ids_T = res
    return jnp.zeros(table.shape, F32).at[ids_T].add(g.astype(F32)).astype(table.dtype), None


embedding.defvjp(lambda table, ids: (embedding(table, ids), (table, ids)), _embedding_bwd)


def row_ids(p: dict, inputs_T) -> dict:
    """The rows a sequence reads of the two tables looked up by `embedding` (the token embedding: the
    tokens; the bigram table: their bigram_hash)."""
    return {"embed.weight": inputs_T, "bigram_embed.weight": bigram_hash(inputs_T, p["bigram_embed.weight"].shape[0])}


def f32(x):
    return x.astype(F32)


def bigram_hash(inputs_T, buckets: int):
    """The reference's bigram bucket of each position: (36313·cur XOR 27191·prev) mod (buckets - 1) in
    wrapping int32; position 0 takes the last bucket, and position 1 hashes with prev = that bucket
    (the reference writes it into the array before hashing)."""
    mod = buckets - 1
    x = inputs_T.astype(jnp.int32).at[0].set(mod)
    h = jnp.bitwise_xor(jnp.int32(BIGRAM_HASH[0]) * x[1:], jnp.int32(BIGRAM_HASH[1]) * x[:-1])
    return jnp.concatenate([x[:1], jnp.mod(h, mod)])  # jnp.mod floors, as torch's %


def rope_freqs(head_dim: int) -> np.ndarray:
    """Half-truncated RoPE: head_dim/4 frequencies (1/1024)^linspace(0, 1), each used by a pair of
    lanes, then head_dim/2 lanes that do not rotate. float32, as the reference builds them with torch:
    linspace's points (a float32 step; the second half counted back from 1 in one rounding, a fused
    multiply-add) and the power rounded once (numpy's float32 linspace and power were up to 7 ulps
    off). The same bits as CPU torch's for head sizes 16 to 128 (tests/ref89_schedule.tsv: 16, 128)."""
    n = head_dim // 4
    i, step = np.arange(n), np.float32(1) / np.float32(n - 1)
    back = 1.0 - np.float64(step) * (n - 1 - i)  # exact in float64: one rounding below
    t = np.where(i < n // 2, step * i.astype(np.float32), back.astype(np.float32)).astype(np.float32)
    f = (2.0 ** (-10.0 * t.astype(np.float64))).astype(np.float32)  # (1/1024)^t, exact until the rounding
    return np.concatenate([np.repeat(f, 2), np.zeros(head_dim // 2, np.float32)])


def yarn_state(step: int, hp: Hyperparameters) -> tuple:
    """(rotary frequencies, attention scale) at a step: YaRN rescales both at each long-window change
    (alpha 1, beta 32), cumulatively, in float32 as the reference's Yarn.apply. The final
    validation's wider window gets no update."""
    freq = rope_freqs(hp.head_dim)
    scale = 0.1
    k_now = stage_of(step, hp)[0]
    for k in range(k_now):
        old, new = hp.stages[k].windows[1] * BLOCK, hp.stages[k + 1].windows[1] * BLOCK
        if old == new:
            continue
        rotations = np.float32(old) * freq / np.float32(2 * math.pi)
        ratio = old / new
        ramp = np.clip((rotations - np.float32(1)) / np.float32(32 - 1), 0, 1).astype(np.float32)
        freq = (freq * (np.float32(ratio) + ramp * np.float32(1 - ratio))).astype(np.float32)
        scale *= 0.2 * math.log(new / old) + 1
    return freq, scale


def rotary(x_TxHxK, freq_K, positions_T, paired: bool):
    """RoPE with the reference's tables: angles t·freq in fp32, cos and sin rounded to bf16, lanes
    rotated in adjacent pairs. Paired layers view (T, H, K) as (T, H/2, 2K): the first K lanes take
    the angles of position 2t, the last K those of 2t+1."""
    T, H, K = x_TxHxK.shape
    if paired:
        x_TxHxK = x_TxHxK.reshape(T, H // 2, 2 * K)
        theta = jnp.concatenate([(2 * positions_T)[:, None] * freq_K, (2 * positions_T + 1)[:, None] * freq_K], -1)
    else:
        theta = positions_T[:, None] * freq_K
    cos, sin = jnp.cos(theta).astype(BF16), jnp.sin(theta).astype(BF16)
    x = f32(x_TxHxK)
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    flipped = jnp.flip(pairs, -1).reshape(x.shape)  # (x1, x0) for each lane pair (x0, x1)
    sign = jnp.tile(jnp.array([1.0, -1.0], F32), x.shape[-1] // 2)
    y = f32(cos)[:, None, :] * x + (f32(sin) * sign)[:, None, :] * flipped
    return y.astype(BF16).reshape(T, H, K)


# --- attention ------------------------------------------------------------------
# Document-causal attention with a token-level window (the reference's FA3 call with
# window_size=(W, 0): query i sees keys i-W..i of its own document, W + 1 keys), exact in pure JAX.
# Blocks of 128 queries meet the key blocks n-d, d = 0..ceil(W/128), one block diagonal at a time,
# with online softmax: memory O(T·128), compute O(T·W). W and the softmax scale are runtime values,
# so one compiled program serves every stage. The backward is written out (custom_vjp, recomputing
# probabilities from the saved log-sum-exp) because autodiff of the loop would keep every diagonal.
# A train program passes max_diagonals, the most diagonals its stages' windows need: the loop then
# has a static trip count, which a GPU runs without a host round trip per diagonal (a runtime count
# reads each loop test back to the host: 40% of the last stage's step idle on an H200, 2026-11-26);
# diagonals beyond the window are masked out whole, so the result is the same (bit for bit on CPU).


def _blocks(x_TxHxK):
    T, H, K = x_TxHxK.shape
    return x_TxHxK.reshape(T // BLOCK, BLOCK, H, K).transpose(0, 2, 1, 3)  # N x H x B x K


def _unblocks(x_NxHxBxK):
    N, H, B, K = x_NxHxBxK.shape
    return x_NxHxBxK.transpose(0, 2, 1, 3).reshape(N * B, H, K)


def _diagonal_mask(d, docs_NxB, window):
    """Which (query, key) pairs of query block n and key block n - d may attend."""
    N = docs_NxB.shape[0]
    i = jnp.arange(BLOCK)
    distance_BxB = d * BLOCK + i[:, None] - i[None, :]  # query position - key position
    in_window_BxB = (distance_BxB >= 0) & (distance_BxB <= window)
    same_doc_NxBxB = docs_NxB[:, :, None] == jnp.roll(docs_NxB, d, axis=0)[:, None, :]
    exists_N = jnp.arange(N) >= d
    return (in_window_BxB[None] & same_doc_NxBxB & exists_N[:, None, None])[:, None]  # N x 1 x B x B


def _scores(d, q, k, scale):
    kd = jnp.roll(k, d, axis=0)  # kd[n] = k[n - d]; wrapped rows are masked
    return jnp.einsum("nhqd,nhkd->nhqk", q, kd, preferred_element_type=F32) * scale


def _num_diagonals(window, N=None):
    """Key-block diagonals a window of `window` tokens reaches (a traced value or an int), at most N."""
    n = window // BLOCK + 1 + (window % BLOCK > 0)
    return n if N is None else jnp.clip(n, 1, N)


def _diagonal_loop(window, N, max_diagonals, body, init):
    """fori_loop over the diagonals the window needs: that many (a runtime count), or max_diagonals (a
    static one; then a window needing more poisons the result with NaN instead of cutting it short)."""
    n = _num_diagonals(window, N)
    if max_diagonals is None:
        return jax.lax.fori_loop(0, n, body, init)
    out = jax.lax.fori_loop(0, min(max_diagonals, N), body, init)
    return jax.tree.map(lambda x: jnp.where(n > max_diagonals, jnp.nan, x), out)


def _attention_with_lse(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, max_diagonals=None):
    q, k, v = _blocks(q_TxHxK), _blocks(k_TxHxK), _blocks(v_TxHxK)
    N, H, B, K = q.shape
    docs_NxB = docs_T.reshape(N, B)

    def diagonal(d, carry):
        m, l, acc = carry
        s = jnp.where(_diagonal_mask(d, docs_NxB, window), _scores(d, q, k, scale), -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))  # finite from d = 0 on: every query sees itself
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("nhqk,nhkd->nhqd", p.astype(v.dtype), jnp.roll(v, d, axis=0), preferred_element_type=F32)
        return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    init = (jnp.full((N, H, B), -jnp.inf, F32), jnp.zeros((N, H, B), F32), jnp.zeros((N, H, B, K), F32))
    m, l, acc = _diagonal_loop(window, N, max_diagonals, diagonal, init)
    return _unblocks(acc / l[..., None]).astype(q_TxHxK.dtype), m + jnp.log(l)


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def window_attention(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, max_diagonals=None):
    """softmax(scale·q·kᵀ)·v over keys of the same document at most `window` tokens back; bf16 q, k, v,
    fp32 softmax, T a multiple of 128. max_diagonals (static): see _diagonal_loop."""
    return _attention_with_lse(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, max_diagonals)[0]


def _window_attention_fwd(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, max_diagonals=None):
    out, lse = _attention_with_lse(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, max_diagonals)
    return out, (q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, out, lse)


def _window_attention_bwd(max_diagonals, res, dout_TxHxK):
    q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, out_TxHxK, lse = res
    q, k, v, dout = _blocks(q_TxHxK), _blocks(k_TxHxK), _blocks(v_TxHxK), _blocks(dout_TxHxK)
    N, H, B, K = q.shape
    docs_NxB = docs_T.reshape(N, B)
    delta = jnp.sum(f32(dout) * f32(_blocks(out_TxHxK)), axis=-1)  # N x H x B

    def diagonal(d, carry):
        dq, dk, dv = carry
        mask = _diagonal_mask(d, docs_NxB, window)
        p = jnp.where(mask, jnp.exp(_scores(d, q, k, scale) - lse[..., None]), 0.0)
        vd, kd = jnp.roll(v, d, axis=0), jnp.roll(k, d, axis=0)
        dp = jnp.einsum("nhqd,nhkd->nhqk", dout, vd, preferred_element_type=F32)
        ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
        dq = dq + jnp.einsum("nhqk,nhkd->nhqd", ds, kd, preferred_element_type=F32)
        dk_d = jnp.einsum("nhqk,nhqd->nhkd", ds, q, preferred_element_type=F32)
        dv_d = jnp.einsum("nhqk,nhqd->nhkd", p.astype(q.dtype), dout, preferred_element_type=F32)
        # row n of dk_d belongs to key block n - d: roll it back (rows n < d are zero)
        return dq, dk + jnp.roll(dk_d, -d, axis=0), dv + jnp.roll(dv_d, -d, axis=0)

    zeros = jnp.zeros((N, H, B, K), F32)
    dq, dk, dv = _diagonal_loop(window, N, max_diagonals, diagonal, (zeros, zeros, zeros))
    grads = [_unblocks(g).astype(q_TxHxK.dtype) for g in (dq, dk, dv)]
    return (*grads, None, None, jnp.zeros_like(scale))


window_attention.defvjp(_window_attention_fwd, _window_attention_bwd)


def _dc_probs_xla(q, k, docs_T, scale):
    """Each head's probabilities over the keys of blocks n-1 and n side by side (2B keys per query block;
    DC_WINDOW < BLOCK so that suffices): N x H x B x 2B, fp32."""
    N = q.shape[0]
    docs_NxB = docs_T.reshape(N, BLOCK)
    s = jnp.concatenate([_scores(1, q, k, scale), _scores(0, q, k, scale)], -1)
    mask = jnp.concatenate([_diagonal_mask(1, docs_NxB, DC_WINDOW - 1), _diagonal_mask(0, docs_NxB, DC_WINDOW - 1)], -1)
    return jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)


def _two_blocks(x):
    """Blocks n-1 and n of x (N x H x B x K) side by side: N x H x 2B x K (row 0's first half wraps: masked)."""
    return jnp.concatenate([jnp.roll(x, 1, axis=0), x], axis=2)


def _from_two_blocks(g):
    """The transpose of _two_blocks: a cotangent N x H x 2B x K back to its blocks."""
    B = g.shape[2] // 2
    return jnp.roll(g[:, :, :B], -1, axis=0) + g[:, :, B:]


def _dc_mix(p, w1_TxH, w2_TxH, dtype):
    """(a = Σ_g w1_g·p_g (N x B x 2B, fp32), each head's weights c_h = w2_h·a rounded to dtype (N x H x B x 2B),
    w1 and w2 as N x H x B, fp32)."""
    N, H, B, _ = p.shape
    w1, w2 = (f32(w).reshape(N, B, H).transpose(0, 2, 1) for w in (w1_TxH, w2_TxH))
    a = jnp.einsum("ngq,ngqk->nqk", w1, p)
    return a, (w2[..., None] * a[:, None]).astype(dtype), w1, w2


@jax.custom_vjp
def dc_correction(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale):
    """Post-only dynamic composition (the reference's DC kernel): each head h adds
    bf16(w2_h · Σ_g w1_g·p_g) @ v_h, where p_g are head g's attention probabilities over the last
    DC_WINDOW tokens of the document (self included). T a multiple of 128; returns fp32. Its backward is
    written out, rounding where the reference's kernels do (autodiff would round dc_h, the cotangent of a
    bf16 value, and keep ds in fp32)."""
    q, k, v = _blocks(q_TxHxK), _blocks(k_TxHxK), _blocks(v_TxHxK)
    _, cw, _, _ = _dc_mix(_dc_probs_xla(q, k, docs_T, scale), w1_TxH, w2_TxH, v.dtype)
    return _unblocks(jnp.einsum("nhqk,nhkd->nhqd", cw, _two_blocks(v), preferred_element_type=F32))


def _dc_correction_bwd(res, dout_TxHxK):
    """The reference's DC backward: dc_h = dout_h·v_hᵀ in fp32, dw2_h = Σ dc_h·a, da = Σ_h w2_h·dc_h,
    dw1_g = Σ p_g·da, ds_g = bf16(p_g·(w1_g·da - w1_g·dw1_g)), dq = (ds·k)·scale, dk = (dsᵀ·q)·scale,
    dv_h = bf16(w2_h·a)ᵀ·dout_h; probabilities recomputed from q and k. dout in bf16, as the reference's
    kernel takes its bf16 output's: add_dc_correction's is one (bf16 GEMMs, not TF32 ones on fp32 copies)."""
    q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale = res
    q, k, v, dout = (_blocks(x) for x in (q_TxHxK, k_TxHxK, v_TxHxK, dout_TxHxK.astype(BF16)))
    N, H, B, K = q.shape
    p = _dc_probs_xla(q, k, docs_T, scale)
    a, cw, w1, w2 = _dc_mix(p, w1_TxH, w2_TxH, v.dtype)
    dc = jnp.einsum("nhqd,nhkd->nhqk", dout, _two_blocks(v), preferred_element_type=F32)
    dv = _from_two_blocks(jnp.einsum("nhqk,nhqd->nhkd", cw, dout, preferred_element_type=F32))
    dw2 = jnp.sum(dc * a[:, None], axis=-1)
    da = jnp.einsum("nhq,nhqk->nqk", w2, dc)
    dw1 = jnp.einsum("nqk,nhqk->nhq", da, p)
    ds = (p * (w1[..., None] * da[:, None] - (w1 * dw1)[..., None])).astype(q.dtype)
    dq = jnp.einsum("nhqk,nhkd->nhqd", ds, _two_blocks(k), preferred_element_type=F32) * scale
    dk = _from_two_blocks(jnp.einsum("nhqk,nhqd->nhkd", ds, q, preferred_element_type=F32)) * scale
    heads = lambda g: g.transpose(0, 2, 1).reshape(N * B, H)  # noqa: E731  (N x H x B -> T x H)
    return (*(_unblocks(g).astype(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v))), None,
            heads(dw1).astype(w1_TxH.dtype), heads(dw2).astype(w2_TxH.dtype), jnp.zeros_like(scale))


dc_correction.defvjp(lambda *args: (dc_correction(*args), args), _dc_correction_bwd)


def add_dc_correction(y_TxHxK, q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale):
    """y + dc_correction(...) in y's dtype, rounded once."""
    correction = dc_correction(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale)
    return (f32(y_TxHxK) + correction).astype(y_TxHxK.dtype)


def attention(x_TxD, w_qkv_3DxD, w_o_DxD, lambdas, a: dict, layer: int, aux_v_TxHxK=None, xsa_alpha_TxH=None,
              gate_TxH=None, dc_w=None, impl="xla", dc_impl="xla"):
    """One attention sublayer of the reference's CausalSelfAttention on the normed input x.
    `a` holds the runtime schedule values: windows, rotary frequencies, softmax scale, docs, positions
    (and in the XLA path's train programs the static max_diagonals: short, long); `impl` (--attention)
    picks window_attention (xla) or its fused Pallas twin (pallas), `dc_impl` (--dc) add_dc_correction's."""
    attend = ATTENTION[impl]
    T, D = x_TxD.shape
    H, K = NUM_HEADS, D // NUM_HEADS
    paired = layer in PAIRED_LAYERS
    w_qkv = (lambdas[0] * f32(w_qkv_3DxD)).astype(BF16)  # sa_lambdas (bf16 values) scale the weights
    q, k, v = jnp.split(linear(x_TxD, w_qkv).reshape(T, 3 * H, K), 3, axis=1)
    q, k = rms_norm(q), rms_norm(k)
    q, k = rotary(q, a["freq"], a["positions"], paired), rotary(k, a["freq"], a["positions"], paired)
    window = a["window_long"] if layer in LONG_WINDOW_LAYERS else a["window_short"]
    bound = (a["max_diagonals"][layer in LONG_WINDOW_LAYERS],) if "max_diagonals" in a else ()
    if layer in LONG_WINDOW_LAYERS:  # key offset: the non-rotating half of each key comes from the previous token
        k = k.at[1:, :, K // 2:].set(k[:-1, :, K // 2:])
    if aux_v_TxHxK is not None:
        v = (f32(v) + f32(aux_v_TxHxK)).astype(BF16)
    if paired:  # heads 0-2 at even, 3-5 at odd positions of a doubled sequence: adjacent heads see each other
        S = 2 * T
        y = attend(q.reshape(S, H // 2, K), k.reshape(S, H // 2, K), v.reshape(S, H // 2, K),
                   jnp.repeat(a["docs"], 2), window, a["scale"], *bound).reshape(T, H, K)
    else:
        y = attend(q, k, v, a["docs"], window, a["scale"], *bound)
    if dc_w is not None:
        w1 = rms_norm(f32(dc_w[0]), eps=1e-6).astype(BF16)  # normalised over the 6 heads
        y = ADD_DC_CORRECTION[dc_impl](y, q, k, v, a["docs"], w1, dc_w[1], a["scale"])
    if xsa_alpha_TxH is not None:  # gated XSA: remove the part of y along v, per token and head
        v32 = f32(v)
        along = jnp.sum(f32(y) * v32, -1, keepdims=True) / jnp.maximum(jnp.sum(v32 * v32, -1, keepdims=True), 1e-8)
        alpha = jnp.tanh(f32(xsa_alpha_TxH))[..., None]
        y = (f32(y) - alpha * along * v32).astype(BF16)
    if gate_TxH is not None:
        y = (f32(y) * f32(gate_TxH)[..., None]).astype(BF16)
    w_o = (lambdas[1] * f32(w_o_DxD)).astype(BF16)
    return linear(y.reshape(T, D), w_o)


# --- MLP: relu(x W1ᵀ)² W2, FP8 in training ---------------------------------------
# Forward as the reference's fused kernels: the up projection in e4m3 with per-tensor amax scales
# (the activation's measured now, the weight's per layer), the down projection in e4m3 with delayed
# scales (the activation's from this micro-batch slot's previous forward, the weights' from the
# previous step). Backward in bf16 from the saved post-activation, using sqrt(post) for relu(pre).


def _bf16_rounded(x):
    """x rounded to bf16's precision (to nearest, ties to even), kept fp32: where the reference stores a
    value in bf16 and reads it back. Converted to bf16, its bits widened back to fp32, which no compiler
    drops: XLA's GPU compiler drops a bf16 round trip inside a fused computation unless COMPILER_OPTIONS
    (excess precision: an H100 program computed the e4m3 copy of post from fp32 relu(pre)², and dpre from
    sqrt(relu(pre)²) instead of sqrt(post)), XLA:CPU one that a reduction reads, options or not, and
    Pallas's Triton lowering has no reduce_precision. On a GPU the hardware's convert and a shift (the
    rounding on the bits took 6-8 more PTX instructions a value: a quarter of mlp_up's epilogue).
    Infinities and NaNs stay. No derivative (bit operations): only in forwards a custom_vjp or a kernel
    owns (autodiff through it zeroes the gradient: 2026-11-27, at the DC correction's output, tried and
    reverted)."""
    bf16_bits = jax.lax.bitcast_convert_type(x.astype(BF16), jnp.uint16)
    return jax.lax.bitcast_convert_type(bf16_bits.astype(jnp.uint32) << 16, F32)


def _relu2(acc):
    """post = relu(pre)² as the reference's kernel rounds it: pre = bf16(acc), post = bf16(pre²), both
    kept fp32 (on bf16's grid) so that post's e4m3 copy and sqrt(post) read the rounded value."""
    c = _bf16_rounded(jnp.maximum(acc.astype(BF16), 0))
    return _bf16_rounded(c * c)


def _mlp_bwd_bf16(x_TxD, w1_FxD, w2_FxD, post_TxF, g_TxD, impl="xla"):
    dw2 = matmul(post_TxF.T, g_TxD)
    if impl == "pallas":
        dpre = pallas_mlp_dpre(g_TxD, w2_FxD, post_TxF)
    else:
        c = f32(matmul(g_TxD, w2_FxD.T))
        dpre = (2 * c * jnp.sqrt(f32(post_TxF))).astype(BF16)
    dw1 = matmul(dpre.T, x_TxD)
    dx = matmul(dpre, w1_FxD)
    return dx, dw1, dw2


@jax.custom_vjp
def mlp_bf16(x_TxD, w1_FxD, w2_FxD):
    """relu(x W1ᵀ)² W2 in bf16 (validation, and training without FP8)."""
    return _mlp_bf16_fwd(x_TxD, w1_FxD, w2_FxD)[0]


def _mlp_bf16_fwd(x_TxD, w1_FxD, w2_FxD):
    post = _relu2(matmul(x_TxD, w1_FxD.T)).astype(BF16)
    return matmul(post, w2_FxD), (x_TxD, w1_FxD, w2_FxD, post)


mlp_bf16.defvjp(_mlp_bf16_fwd, lambda res, g: _mlp_bwd_bf16(*res, g))


def fp8_dot(a, b, contract, exact=False):
    """An FP8 GEMM with fp32 output. XLA's cuBLASLt GEMM accumulates FP8 products imprecisely (fast
    accumulation, as the reference's forwards ask) only at DEFAULT precision: exact=True (HIGHEST) is
    the reference's use_fast_accum=False (its head backward)."""
    precision = jax.lax.Precision.HIGHEST if exact else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=F32)


def measured_scale(w, axes=None):
    """amax(|w|) / 448 over `axes` in bf16 math, as the reference's quantize_mlp_fp8 measures weights: the
    quotient of the bf16 amax rounded to bf16 (a bf16 division by 448, which XLA's GPU compiler makes a
    product with bf16(1/448), rounded differently)."""
    amax = f32(jnp.maximum(jnp.max(jnp.abs(w), axis=axes), 1e-12).astype(BF16))
    return _bf16_rounded(amax / np.float32(E4M3_MAX))


def quantize_up(w1_FxD):
    """The up projection's per-layer e4m3 copy and scale (the reference's quantize_mlp_fp8, in bf16 math:
    the quotient rounded to bf16, then to e4m3; XLA's GPU compiler would convert the fp32 quotient
    straight to e4m3)."""
    scale = measured_scale(w1_FxD)
    return _bf16_rounded(f32(w1_FxD) / scale).astype(E4M3), scale


def down_weight_scales(mlp_bank, bootstrap, next_L):
    """The scales the down projections' weights are quantized with this step, per layer: measured now
    during the bootstrap, else those computed from the previous step's weights (NaN: none saved)."""
    return jnp.where(bootstrap | jnp.isnan(next_L), measured_scale(mlp_bank[:, 1], axes=(1, 2)), next_L)


def next_down_weight_scales(mlp_bank):
    """The next step's down-projection weight scales: this step's amax x 1.12 / 448, per layer."""
    amax_L = jnp.maximum(f32(jnp.max(jnp.abs(mlp_bank[:, 1]), axis=(1, 2))), 1e-12)
    return amax_L * np.float32(MLP_WEIGHT_HEADROOM / E4M3_MAX)


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def mlp_fp8(x_TxD, w1_FxD, w2_FxD, w2_scale, act_scale, valid_T, impl="xla"):
    """relu(x W1ᵀ)² W2 through e4m3 GEMMs; returns (out, amax of the post-activation). valid_T (bool):
    the rows that count in the amaxes (padding does not; it is clipped into the e4m3 range). impl: xla,
    or pallas (the up projection and the backward's dpre as fused kernels, the same values)."""
    return _mlp_fp8_fwd(x_TxD, w1_FxD, w2_FxD, w2_scale, act_scale, valid_T, impl)[0]


def _mlp_fp8_fwd(x_TxD, w1_FxD, w2_FxD, w2_scale, act_scale, valid_T, impl="xla"):
    w1_f8, w1_scale = quantize_up(w1_FxD)
    amax = f32(jnp.maximum(jnp.max(jnp.where(valid_T[:, None], jnp.abs(x_TxD), 0)), 1e-12))
    x_f8 = jnp.clip(f32(x_TxD) * (E4M3_MAX / amax), -E4M3_MAX, E4M3_MAX).astype(E4M3)
    dequant = w1_scale * amax / np.float32(E4M3_MAX)
    if impl == "pallas":
        post, post_f8, post_amax = pallas_mlp_up(x_f8, w1_f8, dequant, act_scale, valid_T)
    else:
        post32 = _relu2(fp8_dot(x_f8, w1_f8, ((1,), (1,))) * dequant)
        post = post32.astype(BF16)
        post_f8 = jnp.minimum(post32 * (1 / act_scale), E4M3_MAX).astype(E4M3)
        post_amax = f32(jnp.max(jnp.where(valid_T[:, None], post, 0)))  # (bf16 post: fuses with its write)
    w2_f8 = jnp.clip(f32(w2_FxD) / w2_scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    out = (fp8_dot(post_f8, w2_f8, ((1,), (0,))) * (act_scale * w2_scale)).astype(BF16)
    return (out, post_amax), (x_TxD, w1_FxD, w2_FxD, post)


def _mlp_fp8_bwd(impl, res, g):
    dx, dw1, dw2 = _mlp_bwd_bf16(*res, g[0], impl)
    return dx, dw1, dw2, None, None, None


mlp_fp8.defvjp(_mlp_fp8_fwd, _mlp_fp8_bwd)


# --- the network -----------------------------------------------------------------


def mudd(x_TxD, w1_GxD, w2_CxG, b2_C, scale):
    """A MUDD coefficient network: (W2·gelu(W1·x) + b2)·scale, bf16, one column per coefficient."""
    h = jax.nn.gelu(f32(linear(x_TxD, w1_GxD)), approximate=False).astype(BF16)
    return ((f32(linear(h, w2_CxG)) + f32(b2_C)) * scale).astype(BF16)


def layer_weights(p: dict):
    """Each layer's matrices from the banks: {layer: (W_qkv, W_o)} (Q and K as 3 head-pair matrices
    each, then V; O apart) and {layer: (c_fc, c_proj)}. Each bank is unstacked once: the gradient of
    an unstack is one stack, where slicing a bank layer by layer sums one zero-padded copy per layer
    (on CPU 40% of a smoke step)."""
    n = 2 * (NUM_HEADS // 2)
    qk, vo = jnp.unstack(p["qk_bank"]), jnp.unstack(p["vo_bank"])
    attn = {l: (jnp.concatenate([*qk[n * a:n * (a + 1)], vo[2 * a]]), vo[2 * a + 1])
            for a, l in enumerate(ATTN_LAYERS)}
    mlp = {i: jnp.unstack(w) for i, w in enumerate(jnp.unstack(p["mlp_bank"])[:NUM_LAYERS])}
    return attn, mlp


def gpt_hidden(p: dict, inputs_T, a: dict, training: bool, mlp_scales=None, attention_impl: str = "xla",
               mlp_impl: str = "xla", rows=None, dc_impl: str = "xla"):
    """The network up to the final norm for one sequence (int32 (T,), T a multiple of 128).
    `a`: runtime schedule values (see schedule_values). mlp_scales: None (bf16 MLP) or the FP8
    down projection's (weight scales (12,), activation scales (12,)) of this micro-batch slot. rows:
    the embedding rows at row_ids, if the caller looked them up (the train step, for their gradients).
    Returns the normed hidden states (T, D) bf16 and the post-activation amax per layer (11,)."""
    T = inputs_T.shape[0]
    D = p["embed.weight"].shape[1]
    H, K = NUM_HEADS, D // NUM_HEADS
    scalars = p["scalars"]
    # fp32 scalars meeting bf16 activations are rounded to bf16 first (torch's type promotion: the
    # compiled record converts them, eager CPU torch too); resid/post lambdas are cast explicitly
    sa_lambdas = f32(scalars[:2 * NUM_LAYERS].reshape(NUM_LAYERS, 2).astype(BF16))
    smear_lambda = f32(scalars[2 * NUM_LAYERS].astype(BF16))
    skip_scale = f32(jax.nn.sigmoid(scalars[2 * NUM_LAYERS + 1]).astype(BF16))
    resid = p["resid_lambdas"].astype(BF16)
    post = p["post_lambdas"].astype(BF16)
    gate_scale = f32(p["_mudd_gate_scale"].astype(BF16))  # the reference casts it to the activations' dtype
    V = p["embed.weight"].shape[0]

    if rows is None:
        rows = {name: embedding(p[name], ids) for name, ids in row_ids(p, inputs_T).items()}
    x = rows["embed.weight"]
    signs = p["bigram_sign_table"][jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.mod(
        jnp.bitwise_xor(inputs_T[:-1], inputs_T[1:]), p["bigram_sign_table"].shape[0])])]
    x0_bigram = rows["bigram_embed.weight"] * signs
    # the value embeddings by indexing, as the reference: there torch.compile's backward of an index adds
    # the rows' cotangents with bf16 atomics on an H100 (not with nn.Embedding's fp32 sums), as
    # autodiff's bf16 scatter-add does here
    ve = p["value_embeds"].reshape(len(VE_LAYERS), V, D)[:, inputs_T]

    # smear: each token takes a gated share of the previous token's embedding
    smear = smear_lambda * jax.nn.sigmoid(f32(linear(x[1:, :SMEAR_DIMS], p["smear_gate.weight"])))
    x = jnp.concatenate([x[:1], (f32(x[1:]) + smear * f32(x[:-1])).astype(BF16)])
    x = x0 = rms_norm(x)

    pre = mudd(x0, p["mudd_gate_w1"][0], p["mudd_gate_w2"][0, :PRE_GATE], p["mudd_gate_b2"][0, :PRE_GATE], gate_scale)
    xsa = {1: pre[:, 0:6], 3: pre[:, 6:12]}
    gates = {3: pre[:, 12:18]}
    x0_gate = {l: pre[:, 18 + 2 * j:19 + 2 * j] for j, l in enumerate(PRE_INJECT_LAYERS)}
    bigram_gate = {l: pre[:, 19 + 2 * j:20 + 2 * j] for j, l in enumerate(PRE_INJECT_LAYERS)}

    def inject(x_TxD, coef_Tx1):  # bigram embedding into the residual stream
        return (f32(x_TxD) + f32(x0_bigram) * f32(coef_Tx1)).astype(BF16)

    x = inject(x0, bigram_gate[0])
    attn_w, mlp_w = layer_weights(p)
    cache = {0: x}
    amaxes = []
    for i in range(NUM_LAYERS):
        mu = None
        if i == 4:
            g = mudd(x, p["mudd_gate_w1"][1], p["mudd_gate_w2"][1], p["mudd_gate_b2"][1], gate_scale)
            xsa.update({4: g[:, 0:6], 7: g[:, 6:12]})
            gates[10] = g[:, 12:18]
            x0_gate.update({l: g[:, 18 + 2 * j:19 + 2 * j] for j, l in enumerate(POST_INJECT_LAYERS)})
            bigram_gate.update({l: g[:, 19 + 2 * j:20 + 2 * j] for j, l in enumerate(POST_INJECT_LAYERS)})
            skip_gate, dc_w = g[:, 28:29], (g[:, 29:35], g[:, 35:41])
        if i == SKIP_TO:  # no attention: the skip from layer 3
            x = (f32(x) + skip_scale * f32(skip_gate) * f32(cache[SKIP_FROM])).astype(BF16)
        else:
            attn_in = rms_norm(cache.get(7, x))
            aux_v = None
            if i == NUM_LAYERS - 1:  # MUDD at the last layer: V and the residual mix earlier streams
                cache[9] = x
                mu = mudd(x, p["mudd_w1"][0], p["mudd_w2"][0], p["mudd_b2"][0], MUDD_SCALE)
                m = [f32(mu[:, j:j + 1]) for j in range(MUDD_LAYER10)]
                c0, c7, x32 = f32(cache[0]), f32(cache[7]), f32(x)
                v_mudd = (m[0] * c0 + m[1] * c7 + m[2] * x32).astype(BF16)
                x = ((1 + m[5]) * x32 + m[3] * c0 + m[4] * c7).astype(BF16)
                ve_gate = jnp.repeat(mu[:, 6:8], H // 2, axis=-1)[..., None]  # heads 0-2, 3-5
                aux_v = (f32(ve_gate) * f32(ve[4].reshape(T, H, K)) + f32(v_mudd).reshape(T, H, K)).astype(BF16)
            elif i in VE_LAYERS:
                ve_i = ve[VE_LAYERS.index(i)]
                gate_in = jnp.concatenate([attn_in[:, :VE_GATE_DIMS], ve_i[:, :VE_GATE_DIMS]], -1)
                ve_gate = 2 * jax.nn.sigmoid(f32(linear(gate_in, p["ve_gate_bank"][VE_LAYERS.index(i)])))
                aux_v = (ve_gate[..., None] * f32(ve_i.reshape(T, H, K))).astype(BF16)
            y = attention(attn_in, *attn_w[i], sa_lambdas[i], a, i, aux_v, xsa.get(i), gates.get(i),
                          dc_w if i == DC_LAYER else None, attention_impl, dc_impl)
            if mu is not None:
                x = (m[8] * f32(x) + m[9] * f32(y) + m[10] * f32(cache[0])).astype(BF16)
                x = inject(x, mu[:, 11:12])
            else:
                x = (f32(resid[i, 0]) * f32(x) + f32(post[i, 0]) * f32(y) + f32(x0) * f32(x0_gate[i])).astype(BF16)
                if i != 0:
                    x = inject(x, bigram_gate[i])
        normed = rms_norm(x)
        w1, w2 = mlp_w[i]
        if mlp_scales is None:
            h = mlp_bf16(normed, w1, w2)
        else:
            h, amax = mlp_fp8(normed, w1, w2, mlp_scales[0][i], mlp_scales[1][i], a["valid"], mlp_impl)
            amaxes.append(amax)
        if mu is not None:
            x = (m[12] * f32(x) + m[13] * f32(h)).astype(BF16)
        else:
            x = (f32(resid[i, 1]) * f32(x) + f32(post[i, 1]) * f32(h)).astype(BF16)
        if i in (3, 7):
            cache[i] = x

    mu = mudd(x, p["mudd_w1"][1], p["mudd_w2"][1, :MUDD_FINAL], p["mudd_b2"][1, :MUDD_FINAL], MUDD_SCALE)
    m = [f32(mu[:, j:j + 1]) for j in range(MUDD_FINAL)]
    x = (f32(x) + m[0] * f32(cache[0]) + m[1] * f32(cache[7]) + m[2] * f32(cache[9]) + m[3] * f32(ve[0])
         + m[4] * f32(cache[3])).astype(BF16)
    amax = jnp.stack(amaxes) if amaxes else jnp.zeros(NUM_LAYERS, F32)
    return rms_norm(x), jax.lax.stop_gradient(amax)


# --- losses ------------------------------------------------------------------------
# Training: the reference's fused FP8 head + softcapped cross-entropy. Logits u = x·W through e4m3
# operands (bf16 out), z = 23·bf16(sigmoid((u + 5)/7.5)); each position's loss is Σ_k w_k·(lse - z[t_{i+k}])
# over the multi-token targets inside the sequence plus w_p·(lse - z[prefix(t_i)]) where the target
# has a prefix token. Its gradient is built in the forward (as the kernel does: normaliser Σ_k w_k over
# every MTP weight, e5m2 with saturation) for backward from sum(losses) x grad scale (1, the 8-GPU
# run's). The (T, V) logits exist once, as the GEMM's bf16 output (the reference's too), never in fp32;
# validation's head runs its rows in chunks of LOSS_CHUNK (a validation step's are many more).

LOSS_CHUNK = 4096
E5M2_MAX = 57344.0


def _loss_targets(targets_T, mtp_w, prefix_T, prefix_w, V):
    """(columns (T, P), weights (T, P), weight sum (T,)): the MTP targets t_{i+k} (dropped past the end
    and outside the vocabulary) and the prefix target, P = len(mtp_w) + 1."""
    cols, ws = [], []
    for k in range(mtp_w.shape[0]):
        t = jnp.concatenate([targets_T[k:], jnp.full(k, -1, targets_T.dtype)])
        ok = (t >= 0) & (t < V)
        cols.append(jnp.where(ok, t, 0))
        ws.append(jnp.where(ok, mtp_w[k], 0.0))
    ok = (prefix_T >= 0) & (prefix_T < V)
    cols.append(jnp.where(ok, prefix_T, 0))
    ws.append(jnp.where(ok, prefix_w, 0.0))
    total = jnp.sum(mtp_w) + jnp.where(ok, prefix_w, 0.0)  # every MTP weight counts, as in the kernel
    total = jnp.where(targets_T >= 0, total, 0.0)  # padding (target -1) has no loss and no gradient
    return jnp.stack(cols, 1).astype(jnp.int32), jnp.stack(ws, 1).astype(F32), total.astype(F32)


def _chunks(n, *arrays):
    c = math.gcd(n, LOSS_CHUNK)
    return [x.reshape(n // c, c, *x.shape[1:]) for x in arrays]


# The FP8 logits' dequantization x_s·w_s as three bf16 values, so that cuBLASLt writes the logits in bf16 itself
# (one rounding, in its epilogue): XLA's GEMM rewriter gives an FP8 GEMM a bf16 output only for operands
# dequantized in bf16, whose scales and alpha are bf16 then. Their product is exact in fp32 and 2.2e-6 below
# fp32(x_s)·fp32(w_s), which no product of bf16 values equals (its mantissa is twice the prime 6,847,843).
# With fp32 logits and a pass rounding them, a last-stage step moved 159 GB more (tests/gpu/aot.py).
LM_HEAD_U_FACTORS = (232 * 2.0**-10, 239 * 2.0**-16, 247 * 2.0**-8)  # x's scale, w's scale, cuBLASLt's alpha
LM_HEAD_U_S = np.float32(math.prod(LM_HEAD_U_FACTORS))  # the FP8 logits' dequantization, in fp32
# the logits' gradient's factor, in the reference's order: grad_scale (1) · (A/C) · (1/grad_s)
LM_HEAD_GRAD_COEF = np.float32(1.0) * (np.float32(1.0) / np.float32(SOFTCAP_C) * np.float32(SOFTCAP_A)) * (
    np.float32(1.0) / np.float32(LM_HEAD_GRAD_S))


def _fp8_logits(x_f8, w_f8):
    """The head's bf16 logits: the fp32 sum of the e4m3 products times LM_HEAD_U_S, rounded once."""
    a, b, alpha = (np.asarray(f, BF16) for f in LM_HEAD_U_FACTORS)

    def cuda(x_f8, w_f8):  # XLA's FP8 pattern: cuBLASLt with the two scales and alpha, writing bf16
        u = jax.lax.dot_general(x_f8.astype(BF16) * a, w_f8.astype(BF16) * b, (((1,), (0,)), ((), ())),
                                preferred_element_type=BF16)
        return u * alpha

    def elsewhere(x_f8, w_f8):  # the same in fp32 (XLA:CPU would round the bf16 operands and products), the
        # rounding by reduce_precision: jax 0.10.2's XLA:CPU fused the fp32 product into a reduction reading it,
        # without the bf16 convert's rounding, even behind an optimization barrier
        return jax.lax.reduce_precision(fp8_dot(x_f8, w_f8, ((1,), (0,))) * LM_HEAD_U_S, 8, 7).astype(BF16)

    # XLA's own Triton GEMMs, where XLA_FLAGS turn them back on, would take the bf16 pattern as a bf16 GEMM (its
    # operands and product rounded); the fp32 form they take as an FP8 GEMM rounding its output itself
    return jax.lax.platform_dependent(x_f8, w_f8, cuda=cuda if xla_gemms_are_cublas() else elsewhere,
                                      default=elsewhere)


def _softcap_sigmoid(u, exp=None):
    """sigmoid((u + B)/C) in fp32, before the reference's kernel rounds it to bf16 (_softcap_sig): XLA's
    logistic, or with `exp` 1/(1 + exp(-x)) (the head's Pallas kernel, with its fast exp)."""
    inv_c = np.float32(1.0) / np.float32(SOFTCAP_C)
    x = f32(u) * inv_c + np.float32(SOFTCAP_B) * inv_c
    return jax.nn.sigmoid(x) if exp is None else 1 / (1 + exp(-x))


def _softcap_sig(u):
    """sigmoid((u + B)/C) in fp32, rounded to bf16 as the reference's kernel stores it (_bf16_rounded: where
    reduce_precision's bit arithmetic took 4 more PTX instructions a logit in XLA's passes)."""
    return _bf16_rounded(_softcap_sigmoid(u))


def _capped_lse(z):
    """log-sum-exp over the last axis of softcapped logits z <= A: shifted by A, exp cannot overflow and
    no pass finds the row's max (the reference shifts by the max: the same value up to fp32 rounding)."""
    return np.float32(SOFTCAP_A) + jnp.log(jnp.sum(jnp.exp(z - np.float32(SOFTCAP_A)), axis=-1))


def _targeted(column, cols, ws):
    """The target columns' weights where `column` is one of them, summed where columns coincide, elementwise:
    at every column of a tile (head_grad's kernel, in its one pass) or at the targets' own (XLA's head)."""
    return sum(jnp.where(column == c, w, np.float32(0)) for c, w in zip(cols, ws))


def _logit_grads(sig, lse, total, targeted, exp=jnp.exp):
    """The e5m2 gradient of the loss sum at the logits u, over grad_s (the reference's kernel): with
    z = A·sig, d/dz = total·softmax(z) - targeted, times dz/du = (A/C)·sig·(1 - sig)."""
    grad_z = total[:, None] * exp(np.float32(SOFTCAP_A) * sig - lse[:, None]) - targeted
    g = LM_HEAD_GRAD_COEF * grad_z * sig * (1 - sig)
    return jnp.clip(g, -E5M2_MAX, E5M2_MAX).astype(E5M2)


def _train_head_fwd(x_TxD, w_DxV, cols_TxP, ws_TxP, total_T, impl="xla"):
    x_f8 = (f32(x_TxD) / np.float32(LM_HEAD_X_S)).astype(E4M3)
    w_f8 = (f32(w_DxV) / np.float32(LM_HEAD_W_S)).astype(E4M3)
    if impl == "pallas":
        # one kernel keeps each logit's bf16 sigmoid with the normaliser's sums beside, as the reference's
        # kernel does in shared memory; the gradient's kernel reads the sigmoids
        sig_grad, lse = pallas_head_softcap(_fp8_logits(x_f8, w_f8))
        sig_t = f32(jnp.take_along_axis(sig_grad, cols_TxP, axis=1))
        g = pallas_head_grad(sig_grad, lse, total_T, cols_TxP, ws_TxP)
    else:
        # Two passes read the (T, V) bf16 logits u, normaliser then gradient, each computing the sigmoid
        # anew: u passed twice through one barrier keeps XLA's GPU compiler from computing it once into
        # an fp32 (T, V) array that both passes read (tests/gpu/aot.py's estimate: 15 -> 9 bytes per logit)
        u = _fp8_logits(x_f8, w_f8)
        u_norm, u_grad = jax.lax.optimization_barrier((u, u))
        lse = _capped_lse(np.float32(SOFTCAP_A) * _softcap_sig(u_norm))
        sig_t = _softcap_sig(jnp.take_along_axis(u_grad, cols_TxP, axis=1))
        # the gradient pass as if no column were a target, then the few target columns of each row set
        # anew (in place): the pass compares no column with the targets (its PTX for sm_90 at the last stage,
        # with _softcap_sig's convert: 72 -> 56 instructions a logit, tests/gpu/aot.py --head-ptx), and every
        # logit's value is the same formula's.
        # A column that is several targets gets the same value from each, whichever is written last.
        cols = [cols_TxP[:, k:k + 1] for k in range(cols_TxP.shape[1])]
        ws = [ws_TxP[:, k:k + 1] for k in range(ws_TxP.shape[1])]
        g = _logit_grads(_softcap_sig(u_grad), lse, total_T, np.float32(0))
        g_TxP = _logit_grads(sig_t, lse, total_T, _targeted(cols_TxP, cols, ws))
        g = g.at[jnp.arange(g.shape[0])[:, None], cols_TxP].set(g_TxP)
    losses = jnp.sum(ws_TxP * (lse[:, None] - np.float32(SOFTCAP_A) * sig_t), axis=1)
    return losses, g, x_f8, w_f8


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def train_head_loss(x_TxD, w_DxV, cols_TxP, ws_TxP, total_T, impl="xla"):
    """(sum of per-token losses, per-token losses) of the fused FP8 head; differentiate the sum. impl:
    xla, or pallas (after the same GEMM, the softcap, normaliser and gradient as two Pallas passes with
    a fast exp: on a GPU the same values up to its last bits)."""
    losses = _train_head_fwd(x_TxD, w_DxV, cols_TxP, ws_TxP, total_T, impl)[0]
    return jnp.sum(losses), losses


def _train_head_vjp_fwd(x_TxD, w_DxV, cols_TxP, ws_TxP, total_T, impl="xla"):
    losses, g, x_f8, w_f8 = _train_head_fwd(x_TxD, w_DxV, cols_TxP, ws_TxP, total_T, impl)
    return (jnp.sum(losses), losses), (g, x_f8, w_f8)


def _train_head_vjp_bwd(impl, res, ct):
    g, x_f8, w_f8 = res
    ct_sum = ct[0]  # the per-token losses are for logging: their cotangent is ignored
    gs = np.float32(LM_HEAD_GRAD_S)
    dx = (fp8_dot(g, w_f8, ((1,), (1,)), exact=True) * (gs * np.float32(LM_HEAD_W_S)) * ct_sum).astype(BF16)
    # cuBLASLt's FP8 GEMM reads both operands along the summed axis, so dw reads g transposed: a copy of
    # its own behind the barrier, which XLA would otherwise write from the gradient's pass as a second
    # output, a transposing pass twice as slow (one H200, 2026-11-27: 114 against 58 ms a last-stage step)
    g_dw = jax.lax.optimization_barrier(g)
    dw = fp8_dot(x_f8, g_dw, ((0,), (0,)), exact=True) * (np.float32(LM_HEAD_X_S) * gs) * ct_sum
    return dx, dw.astype(BF16), None, None, None


train_head_loss.defvjp(_train_head_vjp_fwd, _train_head_vjp_bwd)


def eval_head_loss(x_TxD, w_DxV, targets_T):
    """Validation: the bf16 head, the softcap in fp32, plain cross-entropy per token."""
    T = x_TxD.shape[0]

    def softcap(u):
        return SOFTCAP_A * jax.nn.sigmoid((f32(u) + SOFTCAP_B) / SOFTCAP_C)

    def chunk(args):
        x, t = args
        u = linear(x, w_DxV.T)
        # the softcap computed inside the one pass over the bf16 logits and again at the targets, never
        # kept as an fp32 (T, V) array
        return _capped_lse(softcap(u)) - softcap(jnp.take_along_axis(u, t[:, None], axis=1))[:, 0]

    parts = _chunks(T, x_TxD, targets_T)
    return jax.lax.map(chunk, tuple(parts)).reshape(T)


def gpt2_vocab() -> str:
    """data/gpt2.tiktoken (GPT-2's token ranks, shipped with the repository) next to this script, or in
    the current folder (a copy of the script elsewhere, run from the repository)."""
    places = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gpt2.tiktoken"),
              os.path.join(os.getcwd(), "data", "gpt2.tiktoken")]
    for path in places:
        if os.path.isfile(path):
            return path
    raise DataError(f"the GPT-2 vocabulary (for the prefix-token loss) is not at {' nor '.join(places)}: run from the "
                    f"repository's folder, or copy its data/gpt2.tiktoken next to the script's data/")


def prefix_table(V: int) -> np.ndarray:
    """Each token's prefix token: the longest proper prefix of its bytes that is itself a GPT-2 token
    (-1: none, or not below V). Built from the GPT-2 ranks file shipped in data/."""
    import tiktoken.load
    ranks = tiktoken.load.load_tiktoken_bpe(gpt2_vocab())
    table = np.full(V, -1, np.int32)
    for b, t in ranks.items():
        if t < V:
            n = next((n for n in range(len(b) - 1, 0, -1) if b[:n] in ranks), 0)
            if n and ranks[b[:n]] < V:
                table[t] = ranks[b[:n]]
    return table


def schedule_values(step: int, hp: Hyperparameters, final_val: bool = False) -> dict:
    """The runtime values of the forward at a step: windows (tokens), YaRN frequencies and softmax
    scale, MTP and prefix weights, the BOS id. Arrays of fixed shape per stage, so one program serves a stage."""
    freq, scale = yarn_state(step, hp)
    short, long = windows(step, hp, final_val)
    mtp, pw = loss_weights(step, hp)
    return {"window_short": jnp.int32(short), "window_long": jnp.int32(long), "freq": jnp.asarray(freq),
            "scale": jnp.float32(scale), "mtp": jnp.asarray(mtp), "prefix_w": jnp.float32(pw),
            "bos": jnp.int32(hp.bos_id)}


def fp8_mlp_scales(params: dict, step: int, hp: Hyperparameters, slot: int = 0):
    """(weight scales, activation scales) of the FP8 down projections at a step, from the state
    buffers in params (the bootstrap re-measures the weight scales)."""
    w = down_weight_scales(params["mlp_bank"], step <= hp.fp8_bootstrap_steps, params["_mlp_down_proj_next_scales"])
    act = params["_mlp_down_act_scales"]
    return w, act[slot] if act.ndim == 2 else act


def sequence_loss(p: dict, inputs_T, targets_T, a: dict, training: bool, mlp_scales=None, prefix_T=None,
                  attention_impl: str = "xla", mlp_impl: str = "xla", head_impl: str = "xla", rows=None,
                  dc_impl: str = "xla"):
    """Per-token losses of one sequence (and the sum backward starts from, and the MLP amaxes).
    Targets < 0 mark padding (loss_fn's): no loss, and left out of the FP8 amaxes. rows: gpt_hidden's."""
    a = {**a, "docs": jnp.cumsum(inputs_T == a["bos"], dtype=jnp.int32),  # a BOS opens a document
         "positions": jnp.arange(inputs_T.shape[0], dtype=F32), "valid": targets_T >= 0}
    h, amax = gpt_hidden(p, inputs_T, a, training, mlp_scales, attention_impl, mlp_impl, rows, dc_impl)
    if not training:
        losses = eval_head_loss(h, p["lm_head.weight"], targets_T)
        return jnp.sum(losses), losses, amax
    cols, ws, total = _loss_targets(targets_T, a["mtp"], prefix_T, a["prefix_w"], p["lm_head.weight"].shape[1])
    loss_sum, losses = train_head_loss(h, p["lm_head.weight"], cols, ws, total, head_impl)
    return loss_sum, jax.lax.stop_gradient(losses), amax


def loss_fn(params: dict, tokens, hp: Hyperparameters, step: int, training: bool = True, final_val: bool = False):
    """Per-token losses of one flat token array (inputs tokens[:-1], targets tokens[1:]) at schedule
    step `step`, as ref89's `loss --out` saves them: training with FP8 (MLP and head, the state buffers
    in params), MTP and prefix terms; or validation (training=False)."""
    inputs, targets, T = padded_sequence(tokens, hp.bos_id)
    a = schedule_values(step, hp, final_val)
    if not training:
        return _jit_sequence_loss(params, inputs, targets, a, False)[1][:T]
    # train_grads' program, its gradients unused: one compile of the model serves both (on a CPU,
    # 28 s to compile, 0.8 s to run forward and backward on 256 tokens)
    return training_pass(params, inputs, targets, a, step, hp)[2][:T]


def training_pass(params: dict, inputs_T, targets_T, a: dict, step: int, hp: Hyperparameters) -> tuple:
    """(gradients, loss, per-token losses) of one padded sequence in training mode at step `step`
    (schedule values `a`): the check API's one training program."""
    train = trainable(params, hp)
    return _jit_grads(train, {k: v for k, v in params.items() if k not in train}, inputs_T, targets_T, a,
                      *training_inputs(params, targets_T, step, hp))


def training_inputs(params: dict, targets_T, step: int, hp: Hyperparameters) -> tuple:
    """What a training forward of the check API takes besides the schedule: the FP8 down projections'
    scales at the step, and the targets' prefix tokens."""
    return fp8_mlp_scales(params, step, hp), prefix_targets(jnp.asarray(prefix_table(hp.padded_vocab)), targets_T)


def prefix_targets(table_V, targets_T):
    """Each target's prefix token (-1: none, and for padding)."""
    return jnp.where(targets_T >= 0, table_V[jnp.maximum(targets_T, 0)], -1)


def padded_sequence(tokens, bos: int) -> tuple:
    """(inputs, targets, T) of a flat token array, padded to a multiple of 128 positions (attention's
    block): padding comes after the sequence, so causal attention never sees it, and its targets are -1."""
    tokens = np.asarray(tokens, np.int32)
    T = tokens.size - 1
    pad = -T % BLOCK
    inputs = np.concatenate([tokens[:-1], np.full(pad, bos, np.int32)])
    targets = np.concatenate([tokens[1:], np.full(pad, -1, np.int32)])
    return jnp.asarray(inputs), jnp.asarray(targets), T


_jit_sequence_loss = jax.jit(sequence_loss, static_argnums=4, compiler_options=COMPILER_OPTIONS)


# --- weights interop: ref89's npz (float32 arrays by the reference's parameter and buffer names) ---


def load_weights(path: str, hp: Hyperparameters) -> dict:
    """Parameters and state buffers from an npz as ref89's `init` writes it. bigram_sign_table is
    required; without the FP8 scale buffers the activation scales start at 1.0 and the weight scales
    are re-measured (the state of step 0)."""
    expected = {**param_shapes(hp), **buffer_shapes(hp)}
    try:
        with np.load(path) as f:
            arrays = dict(f)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"cannot read weights {os.path.abspath(path)} ({type(e).__name__}: {e}): pass an .npz "
                        f"written by --save-weights or by ref89.py init") from None
    optional = {"_mlp_down_act_scales", "_mlp_down_proj_scales", "_mlp_down_proj_next_scales"}
    missing = sorted(set(expected) - set(arrays) - optional)
    wrong = [f"{k}: file {arrays[k].shape}, model {expected[k][0]}" for k in expected
             if k in arrays and arrays[k].shape != tuple(expected[k][0])]
    if missing or wrong:
        raise DataError(f"{os.path.abspath(path)} does not fit the model of these hyperparameters: missing "
                        f"{missing}, wrong shapes {wrong}")
    out = {k: jnp.asarray(arrays[k] if k in arrays else np.ones(shape, np.float32), dtype=dtype)
           for k, (shape, dtype) in expected.items()}
    if "_mlp_down_proj_next_scales" not in arrays:  # no delayed scale to use: re-measure at the next step
        out["_mlp_down_proj_next_scales"] = jnp.full_like(out["_mlp_down_proj_next_scales"], jnp.nan)
    return out


def save_weights(weights: dict, path: str) -> None:
    """ref89's npz format, written under a temporary name and renamed (PATH is the old file or the new one)."""
    arrays = {k: np.asarray(jax.device_get(v)).astype(np.float32) for k, v in weights.items()}
    tmp = path + ".tmp.npz"
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def train_grads(params: dict, tokens, hp: Hyperparameters, step: int) -> tuple:
    """(gradients of sum(per-token losses) x grad scale by parameter name, that loss) for one flat token
    array at schedule step `step` in training mode, as ref89's `grads` computes them."""
    inputs, targets, _ = padded_sequence(tokens, hp.bos_id)
    return training_pass(params, inputs, targets, schedule_values(step, hp), step, hp)[:2]


@partial(jax.jit, compiler_options=COMPILER_OPTIONS)
def _jit_grads(trainable, buffers, inputs, targets, a, scales, prefix):
    """(gradients, loss, per-token losses) of one padded sequence in training mode."""
    def loss(trainable):
        total, losses, _ = sequence_loss({**buffers, **trainable}, inputs, targets, a, True, scales, prefix)
        return total, losses

    (value, losses), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
    return grads, value, losses


# --- attention as fused Pallas kernels (Triton on GPUs) ---------------------------------
# window_attention's rule and numerics (same arguments, result and gradients), fused: record 20's
# kernels with the token-level window and the runtime softmax scale of record 89.
# Grid (query block n of BLOCK tokens, head h). XLA turns (W, docs) into two int32 tables, so one
# compiled kernel serves every window and stage:
#   lo_N[n] = first key block query block n sees, hi_N[j] = last query block that sees key block j.
# Both drop the blocks that the window or a document boundary masks entirely (as FlexAttention's block
# mask does) and test the same two conditions, so the forward and dq kernels (key blocks lo_N[n]..n)
# and the dk/dv kernel (query blocks j..hi_N[j]) visit the same block pairs. Inside a visited pair the
# token mask (0 <= i - j <= W, same document) decides, with W and the scale read from one-element
# arrays: they stay runtime values. k, v (q, dout for dk/dv) stay whole-sequence refs in HBM; a loop
# step loads `tile` rows of them. Off GPU the same kernels run in Pallas interpret mode: exact, slow.


# jax 0.11 imports pallas.fuser when it first lowers an interpret-mode kernel (off GPU), which registers
# a config state: the trace context changes and the next call of every jitted function traces and
# compiles again. Imported up front, nothing changes.

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


# Record 20's starting points, not yet tuned on a GPU. At 8 warps an fp32 128 x 128 tile is 64 registers
# per thread: the forward holds its accumulator and 128 x tile scores; dq holds one and dk/dv two
# 128 x 128 accumulators, so their tiles are halved.
PALLAS_FWD = KernelTuning(tile=128, num_warps=8, num_stages=2)
PALLAS_DQ = KernelTuning(tile=64, num_warps=8, num_stages=2)
PALLAS_DKV = KernelTuning(tile=64, num_warps=8, num_stages=2)


def _runtime_rule(window, scale, T):
    """The window clipped to [0, T] (a wider one sees the same keys; int32 stays far from overflow) and
    the scale, as the one-element arrays the kernels read."""
    window_1 = jnp.clip(jnp.asarray(window, jnp.int32), 0, T).reshape(1)
    return window_1, jnp.asarray(scale, F32).reshape(1)


def _block_tables(docs_T, window):
    """(lo_N, hi_N, full_from_N, full_to_N) int32 for a window already clipped to [0, T]. Blocks n >= j
    hold a pair at distance <= W iff (n - j)·BLOCK - (BLOCK - 1) <= W. With nondecreasing docs (cumsum
    of BOS, also repeated for the paired heads) they share a document iff the last doc of block j >= the
    first of block n, and that nearest pair is then visible; other docs skip by the window only.
    The kernels mask only the tiles that need it: every query of block n sees every key in
    [full_from_N[n], n·BLOCK), and every key of block j is seen by every query in [(j+1)·BLOCK,
    full_to_N[j]) (empty ranges where the block spans documents or docs are unsorted)."""
    N = docs_T.shape[0] // BLOCK
    docs_NxB = docs_T.reshape(N, BLOCK)
    first_N, last_N = docs_NxB[:, 0], docs_NxB[:, -1]
    n_N = jnp.arange(N, dtype=jnp.int32)
    reach = (window + BLOCK - 1) // BLOCK  # key blocks back from the diagonal
    sorted_docs = jnp.all(docs_T[1:] >= docs_T[:-1])
    lo_doc_N = jnp.searchsorted(last_N, first_N, side="left", method="compare_all")
    hi_doc_N = jnp.searchsorted(first_N, last_N, side="right", method="compare_all") - 1
    lo_N = jnp.maximum(n_N - reach, jnp.where(sorted_docs, lo_doc_N, 0))
    hi_N = jnp.minimum(n_N + reach, jnp.where(sorted_docs, hi_doc_N, N - 1))
    whole_N = sorted_docs & (first_N == last_N)  # block n within one document, [doc_begin_N, doc_end_N)
    doc_begin_N = jnp.searchsorted(docs_T, first_N, side="left", method="scan_unrolled")
    doc_end_N = jnp.searchsorted(docs_T, first_N, side="right", method="scan_unrolled")
    begin_N, end_N = n_N * BLOCK, (n_N + 1) * BLOCK
    full_from_N = jnp.where(whole_N, jnp.minimum(jnp.maximum(end_N - 1 - window, doc_begin_N), begin_N), begin_N)
    full_to_N = jnp.where(whole_N, jnp.maximum(jnp.minimum(begin_N + window + 1, doc_end_N), end_N), end_N)
    return tuple(t.astype(jnp.int32) for t in (lo_N, hi_N, full_from_N, full_to_N))


def _dot_nt(a, b):  # a @ b.T, fp32 accumulation
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _dot_nn(a, b):  # a @ b, fp32 accumulation
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _visible(q_pos, q_docs, k_pos, k_docs, window):
    distance = q_pos - k_pos
    return (distance >= 0) & (distance <= window) & (q_docs == k_docs)


def _masked(full, masked_value, x, visible):
    """x where a tile's pairs are visible, else masked_value; a tile the block tables call full is taken
    as it is, its mask neither computed nor applied: a scalar branch, the same values (52-65% of the tiles
    at the last stage's windows on documents of 1,000 tokens' mean length; such a loop step has 24-33%
    fewer PTX instructions for sm_90)."""
    return jax.lax.cond(full, lambda x: x, lambda x: jnp.where(visible(), x, masked_value), x)


def _fwd_kernel(lo_ref, full_ref, window_ref, scale_ref, docs_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *, tile):
    n = pl.program_id(0)
    window, scale_log2, full_from = window_ref[0], scale_ref[0] * LOG2_E, full_ref[n]
    q_BxK = q_ref[...]
    q_pos_B = n * BLOCK + jnp.arange(BLOCK)
    q_docs_B = docs_ref[pl.ds(pl.multiple_of(n * BLOCK, BLOCK), BLOCK)]

    def step(i, carry):  # tile i counts back from the diagonal: with tile = BLOCK each row sees itself first
        acc_BxK, m_B, l_B = carry
        k_start = pl.multiple_of((n + 1) * BLOCK - (i + 1) * tile, tile)
        ks = pl.ds(k_start, tile)
        s_BxJ = _dot_nt(q_BxK, k_ref[ks, :]) * scale_log2
        k_docs_J = docs_ref[ks]
        s_BxJ = _masked((k_start >= full_from) & (k_start + tile <= n * BLOCK), MASK_VALUE, s_BxJ, lambda: _visible(
            q_pos_B[:, None], q_docs_B[:, None], (k_start + jnp.arange(tile))[None, :], k_docs_J[None, :], window))
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


def _dq_kernel(lo_ref, full_ref, window_ref, scale_ref, docs_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref,
               dq_ref, *, tile):
    n = pl.program_id(0)
    window, scale, full_from = window_ref[0], scale_ref[0], full_ref[n]
    q_BxK, dout_BxK = q_ref[...], dout_ref[...]
    lse_B, delta_B = lse_ref[...] * LOG2_E, delta_ref[...]
    q_pos_B = n * BLOCK + jnp.arange(BLOCK)
    q_docs_B = docs_ref[pl.ds(pl.multiple_of(n * BLOCK, BLOCK), BLOCK)]
    lo = lo_ref[n]

    def step(i, dq_BxK):
        k_start = pl.multiple_of(lo * BLOCK + i * tile, tile)
        ks = pl.ds(k_start, tile)
        k_JxK = k_ref[ks, :]
        s_BxJ = _dot_nt(q_BxK, k_JxK) * (scale * LOG2_E)
        k_docs_J = docs_ref[ks]
        p_BxJ = _masked((k_start >= full_from) & (k_start + tile <= n * BLOCK), 0.0, jnp.exp2(s_BxJ - lse_B[:, None]),
                        lambda: _visible(q_pos_B[:, None], q_docs_B[:, None], (k_start + jnp.arange(tile))[None, :],
                                         k_docs_J[None, :], window))
        ds_BxJ = p_BxJ * (_dot_nt(dout_BxK, v_ref[ks, :]) - delta_B[:, None]) * scale
        return dq_BxK + _dot_nn(ds_BxJ.astype(k_JxK.dtype), k_JxK)

    dq_BxK = jax.lax.fori_loop(0, (n - lo + 1) * (BLOCK // tile), step, jnp.zeros(q_BxK.shape, F32))
    dq_ref[...] = dq_BxK.astype(dq_ref.dtype)


def _dkv_kernel(hi_ref, full_ref, window_ref, scale_ref, docs_ref, q_ref, k_ref, v_ref, dout_ref, lse_ref, delta_ref,
                dk_ref, dv_ref, *, tile):
    # works on transposed scores (keys x queries) so that every product is a @ b or a @ b.T
    j = pl.program_id(0)
    window, scale, full_to = window_ref[0], scale_ref[0], full_ref[j]
    k_BxK, v_BxK = k_ref[...], v_ref[...]
    k_pos_B = j * BLOCK + jnp.arange(BLOCK)
    k_docs_B = docs_ref[pl.ds(pl.multiple_of(j * BLOCK, BLOCK), BLOCK)]

    def step(i, carry):
        dk_BxK, dv_BxK = carry
        q_start = pl.multiple_of(j * BLOCK + i * tile, tile)
        qs = pl.ds(q_start, tile)
        q_QxK, dout_QxK = q_ref[qs, :], dout_ref[qs, :]
        lse_Q, delta_Q = lse_ref[qs] * LOG2_E, delta_ref[qs]
        s_BxQ = _dot_nt(k_BxK, q_QxK) * (scale * LOG2_E)
        q_docs_Q = docs_ref[qs]
        p_BxQ = _masked((q_start >= (j + 1) * BLOCK) & (q_start + tile <= full_to), 0.0, jnp.exp2(s_BxQ - lse_Q[None, :]),
                        lambda: _visible((q_start + jnp.arange(tile))[None, :], q_docs_Q[None, :], k_pos_B[:, None],
                                         k_docs_B[:, None], window))
        dv_BxK = dv_BxK + _dot_nn(p_BxQ.astype(dout_QxK.dtype), dout_QxK)
        ds_BxQ = p_BxQ * (_dot_nt(v_BxK, dout_QxK) - delta_Q[None, :]) * scale
        return dk_BxK + _dot_nn(ds_BxQ.astype(q_QxK.dtype), q_QxK), dv_BxK

    zeros = jnp.zeros(k_BxK.shape, F32)
    dk_BxK, dv_BxK = jax.lax.fori_loop(0, (hi_ref[j] - j + 1) * (BLOCK // tile), step, (zeros, zeros))
    dk_ref[...] = dk_BxK.astype(dk_ref.dtype)
    dv_ref[...] = dv_BxK.astype(dv_ref.dtype)


# FP8 dots in Triton kernels accumulate as Triton's own frontend has them accumulate on an H100: its
# default for an e4m3/e5m2 dot there is max_num_imprecise_acc = 2**30 (Hopper's FP8 tensor cores add
# with less than fp32's precision; triton-lang/triton#2300), which the reference's FP8 MLP kernel gets
# and its head GEMM asks for (_scaled_mm's use_fast_accum=True), and XLA's own Triton GEMMs use too.
# Pallas builds its tt.dot without the attribute, i.e. 0: exact fp32 accumulation, which Hopper's FP8
# wgmma cannot do, so Triton fell back to Ampere's mma.sync on fp16 copies of the operands (compiled for
# sm_90 without a GPU, 2026-11-27: the FP8 GEMM kernels' PTX held mma.sync, the bf16 kernels' wgmma;
# the 2026-11-27 H100 sweep timed mlp_up at a third of XLA's FP8 GEMM). So the Triton dialect's
# dot builder, which Pallas's Triton lowering calls, gets Triton's default for FP8 operands; other dots
# are untouched. Installed when the first Pallas kernel is built (interpret mode never meets it).
# A K loop's `acc + dot(a, b)` of FP8 operands also becomes one dot accumulating into acc, as the
# reference's kernel writes it (tl.dot(a, b, acc)). Pallas builds every dot from zeros and adds it to acc
# after; Triton's combine pass folds that sum into the dot only for exact dots (maxNumImpreciseAcc 0), so
# each FP8 step waited for its wgmma to finish and added its results to a second accumulator (mlp_up's
# sm_90 PTX, 2026-11-27: wgmma.wait_group 0 and 64 add.f32 a thread in every loop step, where the bf16
# dpre's loop keeps a wgmma in flight), and added each 128-deep step's partial sum to the fp32 total
# exactly: more precisely than the reference's kernel and cuBLASLt's fast accumulation, which carry the
# imprecise sum across K. (A dot whose result were used again would be computed twice: none is.)
TRITON_FP8_IMPRECISE_ACC = 2**30


def _triton_fp8_dots_accumulate_as_on_hopper():
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt
    from jax._src.pallas.triton import lowering
    if getattr(tt.dot, "fp8_imprecise_acc", None) == TRITON_FP8_IMPRECISE_ACC:
        return
    rules = lowering.triton_lowering_rules
    pallas_dot, pallas_add = tt.dot, getattr(rules[jax.lax.add_p], "__wrapped__", rules[jax.lax.add_p])

    def fp8(*xs):
        return all(str(ir.RankedTensorType(x.type).element_type).startswith("f8") for x in xs)

    def is_zero(value):  # a constant 0, dense or splat
        op = getattr(value, "owner", None)
        if getattr(op, "name", None) == "tt.splat":
            op = getattr(op.operands[0], "owner", None)
        if getattr(op, "name", None) != "arith.constant":
            return False
        attr = op.attributes["value"]
        if isinstance(attr, ir.DenseFPElementsAttr) and attr.is_splat:
            attr = attr.get_splat_value()
        return isinstance(attr, ir.FloatAttr) and attr.value == 0

    def dot(a, b, c, *, max_num_imprecise_acc=None, **kwargs):
        if max_num_imprecise_acc is None and fp8(a, b):
            max_num_imprecise_acc = TRITON_FP8_IMPRECISE_ACC
        return pallas_dot(a, b, c, max_num_imprecise_acc=max_num_imprecise_acc, **kwargs)

    def add(ctx, x, y):
        for acc, d in ((x, y), (y, x)):
            op = getattr(d, "owner", None)
            if (getattr(op, "name", None) == "tt.dot" and isinstance(acc, ir.Value) and d.type == acc.type
                    and fp8(*op.operands[:2]) and is_zero(op.operands[2])):  # (the dot from zeros: dead code)
                attrs = op.attributes
                imprecise = attrs["maxNumImpreciseAcc"] if "maxNumImpreciseAcc" in attrs else None
                return pallas_dot(*op.operands[:2], acc, input_precision=attrs["inputPrecision"],
                                  max_num_imprecise_acc=imprecise)
        return pallas_add(ctx, x, y)

    dot.fp8_imprecise_acc, dot.__wrapped__, add.__wrapped__ = TRITON_FP8_IMPRECISE_ACC, pallas_dot, pallas_add
    tt.dot, rules[jax.lax.add_p] = dot, add


# Pallas's Triton lowering addresses an array's elements with i32 offsets when the array has at most 2**32
# bytes (jax 0.10.2 and 0.11.2); an i32 is signed, so in an array of 1-byte elements past 2**31 of them the
# offsets wrap negative, to addresses before its start. The head's e5m2 gradient of a 49,152-row chunk has
# 2.47e9 elements (2026-11-27, an H200: the GPU lane's head case faulted at an illegal address, and the
# short run's loss went NaN two steps into the stage of 49,152-row chunks). Such an array gets i64 offsets,
# as jax gives one past 2**32 bytes.
def _triton_offsets_of_arrays_past_2_31_elements_in_64_bits():
    from jax._src.pallas.triton import lowering
    offsets = lowering._compute_offsets_from_indices
    if hasattr(offsets, "__wrapped__"):
        return

    def wide_offsets(block_info, nd_indexer):
        aval = block_info.full_shape_dtype
        if math.prod(aval.shape) > 2**31:  # described as fp32, which crosses jax's 2**32-byte line
            block_info = dataclasses.replace(block_info, full_shape_dtype=aval.update(dtype=F32))
        return offsets(block_info, nd_indexer)

    wide_offsets.__wrapped__ = offsets
    lowering._compute_offsets_from_indices = wide_offsets


def _pallas(kernel, tuning, name, **call):
    """The kernel as Triton when lowered for CUDA (explicit Triton params: jax 0.10 would pick Mosaic GPU),
    anywhere else the same kernel in interpret mode."""
    _triton_fp8_dots_accumulate_as_on_hopper()
    _triton_offsets_of_arrays_past_2_31_elements_in_64_bits()

    def build(interpret):
        params = pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
        return pl.pallas_call(kernel, compiler_params=params, interpret=interpret, name=name, **call)

    return lambda *args: jax.lax.platform_dependent(*args, cuda=build(False), default=build(True))


def _pallas_specs(T, K):
    """Block specs over the grid (n, h): the two tables, window and scale, docs, block n of head h, all of
    head h, and the same two for H x T rows (lse, delta)."""
    whole = lambda n, h: (0,)  # noqa: E731
    rule = [pl.BlockSpec((T // BLOCK,), whole), pl.BlockSpec((T // BLOCK,), whole), pl.BlockSpec((1,), whole),
            pl.BlockSpec((1,), whole), pl.BlockSpec((T,), whole)]
    return (rule, pl.BlockSpec((BLOCK, None, K), lambda n, h: (n, h, 0)),
            pl.BlockSpec((T, None, K), lambda n, h: (0, h, 0)),
            pl.BlockSpec((None, BLOCK), lambda n, h: (h, n)), pl.BlockSpec((None, T), lambda n, h: (h, 0)))


def _check_pallas_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, name="pallas_window_attention"):
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
    if np.shape(window) != () or np.shape(scale) != ():
        problems.append(f"window shape {np.shape(window)}, scale shape {np.shape(scale)}: pass scalars")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))
    return T, H, K


def _pallas_forward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, tuning=PALLAS_FWD):
    """(out_TxHxK, lse_HxT). lse_HxT[h, t] = natural log of the softmax denominator of query t in head h
    (fp32, head-major: window_attention's N x H x B lse transposed to H x N x B, reshaped)."""
    T, H, K = _check_pallas_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale)
    docs_T = docs_T.astype(jnp.int32)
    window_1, scale_1 = _runtime_rule(window, scale, T)
    lo_N, _, full_from_N, _ = _block_tables(docs_T, window_1[0])
    rule, blk, seq, rows_blk, _ = _pallas_specs(T, K)
    out_shape = (jax.ShapeDtypeStruct.like(q_TxHxK), jax.ShapeDtypeStruct((H, T), F32))
    call = _pallas(partial(_fwd_kernel, tile=tuning.tile), tuning, "attention_fwd", grid=(T // BLOCK, H),
                   out_shape=out_shape, in_specs=[*rule, blk, seq, seq], out_specs=(blk, rows_blk))
    return call(lo_N, full_from_N, window_1, scale_1, docs_T, q_TxHxK, k_TxHxK, v_TxHxK)


def _pallas_backward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, out_TxHxK, lse_HxT, dout_TxHxK,
                     dq_tuning=PALLAS_DQ, dkv_tuning=PALLAS_DKV):
    """(dq, dk, dv) from the saved lse; delta = rowsum(out * dout) is cheap in XLA."""
    T, H, K = q_TxHxK.shape
    docs_T = docs_T.astype(jnp.int32)
    window_1, scale_1 = _runtime_rule(window, scale, T)
    lo_N, hi_N, full_from_N, full_to_N = _block_tables(docs_T, window_1[0])
    delta_HxT = jnp.einsum("thd,thd->ht", out_TxHxK.astype(F32), dout_TxHxK.astype(F32))
    rule, blk, seq, rows_blk, rows_seq = _pallas_specs(T, K)
    like = jax.ShapeDtypeStruct.like
    dq = _pallas(partial(_dq_kernel, tile=dq_tuning.tile), dq_tuning, "attention_dq", grid=(T // BLOCK, H),
                 out_shape=like(q_TxHxK), in_specs=[*rule, blk, seq, seq, blk, rows_blk, rows_blk], out_specs=blk)
    dkv = _pallas(partial(_dkv_kernel, tile=dkv_tuning.tile), dkv_tuning, "attention_dkv", grid=(T // BLOCK, H),
                  out_shape=(like(k_TxHxK), like(v_TxHxK)),
                  in_specs=[*rule, seq, blk, blk, seq, rows_seq, rows_seq], out_specs=(blk, blk))
    args = (window_1, scale_1, docs_T, q_TxHxK, k_TxHxK, v_TxHxK, dout_TxHxK, lse_HxT, delta_HxT)
    return (dq(lo_N, full_from_N, *args), *dkv(hi_N, full_to_N, *args))


@jax.custom_vjp
def pallas_window_attention(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale):
    """window_attention as Pallas kernels: softmax(scale·q·kᵀ)·v over keys of the same document at most
    `window` tokens back (same arguments, result and gradients; scale gets a zero cotangent). Blocks a
    document boundary masks are skipped when docs_T is nondecreasing (cumsum of BOS), as in the model."""
    return _pallas_forward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale)[0]


def _pallas_vjp_fwd(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale):
    out, lse_HxT = _pallas_forward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale)
    return out, (q_TxHxK, k_TxHxK, v_TxHxK, docs_T, window, scale, out, lse_HxT)


def _pallas_vjp_bwd(res, dout_TxHxK):
    return (*_pallas_backward(*res, dout_TxHxK), None, None, jnp.zeros_like(res[5]))


pallas_window_attention.defvjp(_pallas_vjp_fwd, _pallas_vjp_bwd)


# --attention: the same rule. The Pallas one jitted: the layers' calls of one shape share one trace and one
# Triton lowering (the record's four programs lower for an H100 in 15 s instead of 25); XLA inlines the
# call (on CPU the same bits; the H100 program's static cost estimate unchanged)
ATTENTION = {"xla": window_attention, "pallas": jax.jit(pallas_window_attention)}


# --- the DC correction as fused Pallas kernels (--dc pallas) -------------------------------
# dc_correction's result and gradients without its (T, H, 2·BLOCK) fp32 arrays of scores and probabilities
# (tests/gpu/aot.py, the record's last stage, with autodiff's backward then: 83 GB a step, 28 ms of floors,
# for layer 10 alone; the kernels' 9.8 GB, 3.3 ms), as the reference's DC kernels do: a program takes
# DC_ROWS queries (forward, dq) or keys (dk/dv), whose DC_WINDOW-token windows fit one BLOCK of keys
# (queries), all heads at once, since the mix a = Σ_g w1_g·p_g spans the heads. The reference's kernels'
# precision: fp32 scores and probabilities, c_h = bf16(w2_h·a), fp32 sums; in the backward dc_h = dout_h·v_h
# in fp32 and ds rounded to bf16 before its products, as XLA's path's written-out backward. dk and dv are
# summed in fp32 and rounded once, where the reference's programs add their parts into bf16 arrays with
# atomics (in any order).
DC_ROWS = BLOCK - DC_WINDOW  # 16
PALLAS_DC = KernelTuning(tile=DC_ROWS, num_warps=4, num_stages=1)  # tile: DC_ROWS; no loop to pipeline


def _dc_probs(q_ref, k_ref, rows, keys, g, scale_log2, lse_log2, visible):
    """Head g's probabilities of queries `rows` over keys `keys` (rows x keys, fp32) from its log-sum-exp
    (log2 units, per row), or keys x rows from k first."""
    s = _dot_nt(q_ref[rows, g, :], k_ref[keys, g, :]) * scale_log2
    return jnp.where(visible, jnp.exp2(s - lse_log2), 0.0)


def _over_heads(H, body, init):
    """A loop over the heads, not unrolled: each trip loads its head's tiles when it needs them (unrolled,
    the loads of all six ran ahead and spilled registers: tests/gpu/aot.py's ptxas notes)."""
    return jax.lax.fori_loop(0, H, body, init)


def _dc_queries(docs_ref):
    """A forward or dq program's DC_ROWS queries t0.., the BLOCK keys their windows reach (t0 - 112 ..
    t0 + 15, from 0 at the sequence's start) and which (query, key) pairs are visible."""
    t0 = pl.program_id(0) * DC_ROWS
    k0 = pl.multiple_of(jnp.maximum(t0 + DC_ROWS - BLOCK, 0), DC_ROWS)
    rows, keys = pl.ds(pl.multiple_of(t0, DC_ROWS), DC_ROWS), pl.ds(k0, BLOCK)
    visible = _visible((t0 + jnp.arange(DC_ROWS))[:, None], docs_ref[rows][:, None], (k0 + jnp.arange(BLOCK))[None, :],
                       docs_ref[keys][None, :], DC_WINDOW - 1)
    return rows, keys, visible


def _dc_fwd_kernel(scale_ref, docs_ref, q_ref, k_ref, v_ref, w1_ref, w2_ref, y_ref, out_ref, lse_ref):
    rows, keys, visible = _dc_queries(docs_ref)
    scale_log2 = scale_ref[0] * LOG2_E

    def mix(g, a):  # a = Σ_g w1_g·p_g; each row sees itself: its max is finite and its sum >= 1
        s = jnp.where(visible, _dot_nt(q_ref[rows, g, :], k_ref[keys, g, :]) * scale_log2, MASK_VALUE)
        m = s.max(axis=1)
        p = jnp.exp2(s - m[:, None])
        total = p.sum(axis=1)
        lse_ref[g, rows] = m + jnp.log2(total)  # log2 units
        return a + f32(w1_ref[g, rows])[:, None] * (p / total[:, None])

    def correct(h, a):
        c = (f32(w2_ref[h, rows])[:, None] * a).astype(v_ref.dtype)
        out_ref[rows, h, :] = (f32(y_ref[rows, h, :]) + _dot_nn(c, v_ref[keys, h, :])).astype(out_ref.dtype)
        return a

    H = q_ref.shape[1]
    _over_heads(H, correct, _over_heads(H, mix, jnp.zeros((DC_ROWS, BLOCK), F32)))


def _dc_dq_kernel(scale_ref, docs_ref, q_ref, k_ref, v_ref, w1_ref, w2_ref, lse_ref, dout_ref,
                  dq_ref, dw1_ref, dw2_ref, soft_ref):
    rows, keys, visible = _dc_queries(docs_ref)
    scale = scale_ref[0]

    def probs(g):
        return _dc_probs(q_ref, k_ref, rows, keys, g, scale * LOG2_E, lse_ref[g, rows][:, None], visible)

    def mix(g, a):
        return a + f32(w1_ref[g, rows])[:, None] * probs(g)

    def mix_grad(h, carry):  # dc_h = dout_h·v_hᵀ; c_h = bf16(w2_h·a) passes it on to a as w2_h·dc_h
        a, da = carry
        dc = _dot_nt(dout_ref[rows, h, :], v_ref[keys, h, :])
        dw2_ref[h, rows] = jnp.sum(dc * a, axis=1).astype(dw2_ref.dtype)
        return a, da + f32(w2_ref[h, rows])[:, None] * dc

    def probs_grad(g, da):  # p_g = softmax(s_g) gets w1_g·da: ds_g = p_g·(w1_g·da - w1_g·Σ p_g·da)
        p, w1 = probs(g), f32(w1_ref[g, rows])
        dw1 = jnp.sum(p * da, axis=1)
        dw1_ref[g, rows] = dw1.astype(dw1_ref.dtype)
        soft_ref[g, rows] = w1 * dw1
        ds = p * (w1[:, None] * da - (w1 * dw1)[:, None])
        dq_ref[rows, g, :] = (_dot_nn(ds.astype(k_ref.dtype), k_ref[keys, g, :]) * scale).astype(dq_ref.dtype)
        return da

    H, zeros = q_ref.shape[1], jnp.zeros((DC_ROWS, BLOCK), F32)
    _, da = _over_heads(H, mix_grad, (_over_heads(H, mix, zeros), zeros))
    _over_heads(H, probs_grad, da)


def _dc_dkv_kernel(scale_ref, docs_ref, q_ref, k_ref, v_ref, w1_ref, w2_ref, lse_ref, dout_ref, soft_ref,
                   dk_ref, dv_ref):
    # keys j0 .. j0 + 15 and the BLOCK queries from j0 (the sequence's last BLOCK at its end), keys x queries
    j0 = pl.program_id(0) * DC_ROWS
    q0 = pl.multiple_of(jnp.minimum(j0, q_ref.shape[0] - BLOCK), DC_ROWS)
    keys, rows = pl.ds(pl.multiple_of(j0, DC_ROWS), DC_ROWS), pl.ds(q0, BLOCK)
    visible = _visible((q0 + jnp.arange(BLOCK))[None, :], docs_ref[rows][None, :], (j0 + jnp.arange(DC_ROWS))[:, None],
                       docs_ref[keys][:, None], DC_WINDOW - 1)
    scale = scale_ref[0]

    def probs(g):
        return _dc_probs(k_ref, q_ref, keys, rows, g, scale * LOG2_E, lse_ref[g, rows][None, :], visible)

    def mix(g, a):
        return a + f32(w1_ref[g, rows])[None, :] * probs(g)

    def mix_grad(h, carry):
        a, da = carry
        w2, dout = f32(w2_ref[h, rows])[None, :], dout_ref[rows, h, :]
        dv_ref[keys, h, :] = _dot_nn((w2 * a).astype(dout.dtype), dout).astype(dv_ref.dtype)
        return a, da + w2 * _dot_nt(v_ref[keys, h, :], dout)

    def probs_grad(g, da):
        ds = probs(g) * (f32(w1_ref[g, rows])[None, :] * da - soft_ref[g, rows][None, :])
        dk_ref[keys, g, :] = (_dot_nn(ds.astype(q_ref.dtype), q_ref[rows, g, :]) * scale).astype(dk_ref.dtype)
        return da

    H, zeros = q_ref.shape[1], jnp.zeros((DC_ROWS, BLOCK), F32)
    _, da = _over_heads(H, mix_grad, (_over_heads(H, mix, zeros), zeros))
    _over_heads(H, probs_grad, da)


def _dc_call(kernel, name, tuning, args, out_shape):
    """A DC kernel over T / DC_ROWS programs, every operand and result whole (the kernels slice them)."""
    whole = lambda x: pl.BlockSpec(x.shape, lambda n: (0,) * len(x.shape))  # noqa: E731
    T = args[1].shape[0]  # _dc_args's docs
    call = _pallas(kernel, tuning, name, grid=(T // DC_ROWS,), out_shape=out_shape,
                   in_specs=[whole(x) for x in args], out_specs=jax.tree.map(whole, out_shape))
    return call(*args)


def _dc_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale, y_TxHxK=None):
    """The kernels' shared operands: scale as a one-element array, docs, q, k, v, the head weights head-major."""
    name = "pallas_add_dc_correction"
    T, H, K = _check_pallas_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, 0, scale, name)
    if w1_TxH.shape != (T, H) or w2_TxH.shape != (T, H):
        raise ValueError(f"{name}: w1, w2 shapes {w1_TxH.shape}, {w2_TxH.shape}: pass ({T}, {H}) each")
    if y_TxHxK is not None and y_TxHxK.shape != q_TxHxK.shape:
        raise ValueError(f"{name}: y shape {y_TxHxK.shape}: pass q's, {q_TxHxK.shape}")
    return (jnp.asarray(scale, F32).reshape(1), docs_T.astype(jnp.int32), q_TxHxK, k_TxHxK, v_TxHxK, w1_TxH.T, w2_TxH.T)


def _pallas_dc_forward(y_TxHxK, q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale, tuning=PALLAS_DC):
    """(y + the correction in y's dtype, each head's log-sum-exp (H, T) in log2 units)."""
    args = _dc_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale, y_TxHxK)
    T, H = y_TxHxK.shape[:2]
    return _dc_call(_dc_fwd_kernel, "dc_fwd", tuning, (*args, y_TxHxK),
                    (jax.ShapeDtypeStruct.like(y_TxHxK), jax.ShapeDtypeStruct((H, T), F32)))


def _pallas_dc_backward(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale, lse_HxT, dout_TxHxK,
                        tuning=PALLAS_DC):
    """(dq, dk, dv, dw1, dw2) of the correction from the saved log-sum-exp; dout in bf16."""
    args = _dc_args(q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale)
    T, H = q_TxHxK.shape[:2]
    like, heads = jax.ShapeDtypeStruct.like, lambda dtype: jax.ShapeDtypeStruct((H, T), dtype)  # noqa: E731
    dq, dw1, dw2, soft = _dc_call(_dc_dq_kernel, "dc_dq", tuning, (*args, lse_HxT, dout_TxHxK),
                                  (like(q_TxHxK), heads(w1_TxH.dtype), heads(w2_TxH.dtype), heads(F32)))
    dk, dv = _dc_call(_dc_dkv_kernel, "dc_dkv", tuning, (*args, lse_HxT, dout_TxHxK, soft),
                      (like(k_TxHxK), like(v_TxHxK)))
    return dq, dk, dv, dw1.T, dw2.T


@jax.custom_vjp
def pallas_add_dc_correction(y_TxHxK, q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale):
    """add_dc_correction as Pallas kernels (same arguments, result and gradients; scale gets a zero
    cotangent): y's dtype, the sum rounded once, as the reference's kernel adds its correction to y."""
    return _pallas_dc_forward(y_TxHxK, q_TxHxK, k_TxHxK, v_TxHxK, docs_T, w1_TxH, w2_TxH, scale)[0]


def _pallas_dc_vjp_fwd(y_TxHxK, *inputs):
    out, lse_HxT = _pallas_dc_forward(y_TxHxK, *inputs)
    return out, (inputs, lse_HxT)


def _pallas_dc_vjp_bwd(res, dout_TxHxK):
    inputs, lse_HxT = res
    dq, dk, dv, dw1, dw2 = _pallas_dc_backward(*inputs, lse_HxT, dout_TxHxK)
    return dout_TxHxK, dq, dk, dv, None, dw1, dw2, jnp.zeros_like(inputs[-1])


pallas_add_dc_correction.defvjp(_pallas_dc_vjp_fwd, _pallas_dc_vjp_bwd)

# --dc: layer 10's DC correction, the Pallas one jitted as ATTENTION's
ADD_DC_CORRECTION = {"xla": add_dc_correction, "pallas": jax.jit(pallas_add_dc_correction)}


# --- GEMMs with their epilogues as fused Pallas kernels, and the head's passes (Triton on GPUs) ---------
# The MLP (--mlp pallas): the reference's linear_relu_square kernel, in two uses: the FP8 up projection
# writes post = relu(pre)² in bf16, its e4m3 copy for the down projection and the max of post, from
# one GEMM tile each; the backward's g·W2ᵀ writes dpre = 2·c·sqrt(post) straight from its
# accumulator. XLA's GPU compiler keeps these epilogues apart from its GEMMs (tests/gpu/aot.py on the
# record's last stage: the up projection's GEMM writes relu(pre), one pass squares it into post and
# takes its max, another its e4m3 copy: 9 bytes an element of post where the kernel moves 3; the
# backward's c = g·W2ᵀ makes a round trip of 4 more). The same values as mlp_fp8's XLA path.
# The head (--head pallas): the reference's softcapped cross-entropy kernel, as two passes over the
# logits of cuBLASLt's FP8 GEMM (head_softcap, head_grad), with the reference's fast exp. Not a GEMM
# kernel of ours: the head's K is only 768, and a Triton GEMM writing the logits with their normaliser's
# sums ran at 368 TFLOP/s against cuBLASLt's 1,027 (one H200, 2026-11-27: 82.6 ms a last-stage step
# against 29.6 for cuBLASLt's GEMM, plus 27.6 for the rounding pass its fp32 logits had then: _fp8_logits).


@dataclasses.dataclass(frozen=True)
class GemmTuning:
    """Triton knobs of one GEMM kernel: an output tile of rows x cols, `depth` columns of both inputs
    loaded per loop step (tiles smaller than a dimension are cut to fit it: the small presets)."""

    rows: int
    cols: int
    depth: int
    num_warps: int
    num_stages: int

    def fit(self, M, N, K):
        return dataclasses.replace(self, rows=_fit(self.rows, M), cols=_fit(self.cols, N), depth=_fit(self.depth, K))


def _fit(want: int, n: int) -> int:
    """The largest power of two up to `want` that divides n (want a power of two)."""
    while n % want:
        want //= 2
    return want


# The reference's tiles for its kernels of these GEMMs (up: 37.2 ms a last-stage step on an H200, 2026-11-27,
# in a profile the head's out-of-bounds writes disturbed, against 53.0 at 128 x 128 with the old loop; no
# sweep yet): a 128 x 256 fp32 accumulator over 8 warps (128 registers a thread), 3 stages of input tiles
# in shared memory, 64 deep in bf16 (dpre: 48 KiB a stage), 128 in e4m3 (up: 48 KiB). Up was 128 x 128
# while its epilogue spilled registers at 128 x 256 (152 bytes a thread; tests/gpu/aot.py --sweep,
# 2026-11-27): its loop kept a second accumulator then (_triton_fp8_dots_accumulate_as_on_hopper); since,
# no up tile swept spills.
PALLAS_MLP_UP = GemmTuning(rows=128, cols=256, depth=128, num_warps=8, num_stages=3)
PALLAS_MLP_DPRE = GemmTuning(rows=128, cols=256, depth=64, num_warps=8, num_stages=3)


def _gemm_nt(a_ref, b_ref, depth):
    """a_ref @ b_refᵀ over the refs' whole second dimension, `depth` columns a step, fp32 accumulation."""
    def step(k, acc):
        ks = pl.ds(pl.multiple_of(k * depth, depth), depth)
        return acc + _dot_nt(a_ref[:, ks], b_ref[:, ks])
    return jax.lax.fori_loop(0, a_ref.shape[1] // depth, step, jnp.zeros((a_ref.shape[0], b_ref.shape[0]), F32))


class _GemmGrid:
    """The launch grid of a GEMM kernel over output tiles (i, j) of t.rows x t.cols, column tiles first
    (Triton launches the grid's first axis fastest: the programs running together share A's row tile,
    read once, and the weight B stays in the L2), and its block specs: A's rows i (M x K), B's rows j
    (N x K), whole in K (the kernel loops over it), and output blocks of any shape at (i, j). Every
    Pallas GEMM here takes A and B first (tests/test_gpu.py reads them as the GEMM's operands)."""

    def __init__(self, t: GemmTuning, M: int, N: int, K: int):
        self.tiles = (M // t.rows, N // t.cols)
        self.grid = self.tiles[::-1]
        self.operands = [self.block((t.rows, K), lambda i, j: (i, 0)), self.block((t.cols, K), lambda i, j: (j, 0))]

    def block(self, shape, index=lambda i, j: (i, j)):
        """A block spec of `shape` at index(i, j) of the output tile (i, j) a program computes."""
        return pl.BlockSpec(shape, lambda j, i: index(i, j))


def _mlp_up_kernel(x_ref, w_ref, scales_ref, valid_ref, post_ref, post_f8_ref, amax_ref, *, depth):
    post = _relu2(_gemm_nt(x_ref, w_ref, depth) * scales_ref[0])
    post_ref[...] = post.astype(BF16)
    post_f8_ref[...] = jnp.minimum(post * scales_ref[1], E4M3_MAX).astype(E4M3)
    # post >= 0: the valid rows' maxima, not a select per value
    amax_ref[...] = jnp.max(jnp.where(valid_ref[...] != 0, jnp.max(post, axis=1), 0)).reshape(1, 1)


def _mlp_dpre_kernel(g_ref, w_ref, post_ref, dpre_ref, *, depth):
    c = _bf16_rounded(_gemm_nt(g_ref, w_ref, depth))  # c = g·W2ᵀ rounded to bf16, as the reference's kernel
    dpre_ref[...] = (2 * c * jnp.sqrt(f32(post_ref[...]))).astype(BF16)


def pallas_mlp_up(x_f8, w1_f8, dequant, act_scale, valid_T, tuning=PALLAS_MLP_UP):
    """(post, post_f8, amax): post = relu(dequant·x_f8·w1_f8ᵀ)² in bf16, its e4m3 copy min(post·(1/act_scale),
    448) and the max of post over the valid rows, as _mlp_fp8_fwd computes them. T, F multiples of 16."""
    (T, D), F = x_f8.shape, w1_f8.shape[0]
    t = tuning.fit(T, F, D)
    g = _GemmGrid(t, T, F, D)
    tile = g.block((t.rows, t.cols))
    call = _pallas(partial(_mlp_up_kernel, depth=t.depth), t, "mlp_up", grid=g.grid,
                   out_shape=(jax.ShapeDtypeStruct((T, F), BF16), jax.ShapeDtypeStruct((T, F), E4M3),
                              jax.ShapeDtypeStruct(g.tiles, F32)),
                   in_specs=[*g.operands, g.block((2,), lambda i, j: (0,)), g.block((t.rows,), lambda i, j: (i,))],
                   out_specs=(tile, tile, g.block((1, 1))))
    scales = jnp.stack([jnp.asarray(dequant, F32), 1 / jnp.asarray(act_scale, F32)])
    post, post_f8, amax_tiles = call(x_f8, w1_f8, scales, valid_T.astype(jnp.int32))
    return post, post_f8, jnp.max(amax_tiles)


def pallas_mlp_dpre(g_TxD, w2_FxD, post_TxF, tuning=PALLAS_MLP_DPRE):
    """dpre = bf16(2·bf16(g·W2ᵀ)·sqrt(post)), as _mlp_bwd_bf16 computes it."""
    (T, D), F = g_TxD.shape, w2_FxD.shape[0]
    t = tuning.fit(T, F, D)
    g = _GemmGrid(t, T, F, D)
    tile = g.block((t.rows, t.cols))
    call = _pallas(partial(_mlp_dpre_kernel, depth=t.depth), t, "mlp_dpre", grid=g.grid,
                   out_shape=jax.ShapeDtypeStruct((T, F), BF16), in_specs=[*g.operands, tile], out_specs=tile)
    return call(g_TxD, w2_FxD.astype(g_TxD.dtype), post_TxF)


@dataclasses.dataclass(frozen=True)
class PassTuning:
    """Triton knobs of an elementwise pass over a (T, V) array: a program's tile of rows x cols (cut to fit
    the small presets, as GemmTuning's)."""

    rows: int
    cols: int
    num_warps: int
    num_stages: int = 1

    def fit(self, M, N):
        return dataclasses.replace(self, rows=_fit(self.rows, M), cols=_fit(self.cols, N))


# A program's 64 x 128 tile over 4 warps: 64 values a thread, loads of 16 bytes (compiled for sm_90 without
# a GPU, 2026-11-27: no spills). 50,304 columns are 393 tiles of 128.
PALLAS_HEAD_PASS = PassTuning(rows=64, cols=128, num_warps=4)


def _exp_fast(x):
    """exp(x) as 2^(x·log2 e): on a GPU the SFU's ex2.approx, as the reference's kernel
    computes exp (nvcc --use_fast_math's __expf); Pallas lowers exp to libdevice's accurate expf, about
    ten, which left the head's passes compute-bound (XLA's exp is the same: its gradient pass, 62
    instructions a logit, moved 1.0 TB/s on an H200, a fifth of its bandwidth, 2026-11-27)."""
    return jnp.exp2(x * np.float32(LOG2_E))


def _head_softcap_kernel(logits_ref, sig_ref, sumexp_ref):
    u = logits_ref[...]  # bf16, as the reference's GEMM writes them
    sig = _bf16_rounded(_softcap_sigmoid(u, _exp_fast))  # _softcap_sig's rounding
    sig_ref[...] = sig.astype(BF16)
    sumexp_ref[...] = jnp.sum(_exp_fast(np.float32(SOFTCAP_A) * sig - np.float32(SOFTCAP_A)), axis=1, keepdims=True)


def pallas_head_softcap(logits_TxV, tuning=PALLAS_HEAD_PASS):
    """(sig, lse) from the FP8 head's bf16 logits u in one pass: sig = bf16(sigmoid((u + B)/C)), as
    _softcap_sig (the value the reference's kernel keeps of each logit), and each row's log-sum-exp of
    z = A·sig, as _capped_lse, from the per-tile sums beside."""
    T, V = logits_TxV.shape
    t = tuning.fit(T, V)
    tile = pl.BlockSpec((t.rows, t.cols), lambda j, i: (i, j))  # column tiles first: a row's in the L2 together
    call = _pallas(_head_softcap_kernel, t, "head_softcap", grid=(V // t.cols, T // t.rows),
                   out_shape=(jax.ShapeDtypeStruct((T, V), BF16), jax.ShapeDtypeStruct((T, V // t.cols), F32)),
                   in_specs=[tile], out_specs=(tile, pl.BlockSpec((t.rows, 1), lambda j, i: (i, j))))
    sig, sumexp_TxJ = call(logits_TxV)
    return sig, np.float32(SOFTCAP_A) + jnp.log(jnp.sum(sumexp_TxJ, axis=1))


def _head_grad_kernel(sig_ref, lse_ref, total_ref, *refs):
    P = len(refs) // 2  # cols_1 .. cols_P, ws_1 .. ws_P, then the output
    sig = f32(sig_ref[...])
    column = pl.program_id(0) * sig.shape[1] + jax.lax.broadcasted_iota(jnp.int32, sig.shape, 1)
    targeted = _targeted(column, [c[...][:, None] for c in refs[:P]], [w[...][:, None] for w in refs[P:2 * P]])
    refs[-1][...] = _logit_grads(sig, lse_ref[...], total_ref[...], targeted, _exp_fast)


def pallas_head_grad(sig_TxV, lse_T, total_T, cols_TxP, ws_TxP, tuning=PALLAS_HEAD_PASS):
    """The e5m2 gradient of the head's loss sum at the logits from the rounded sigmoids sig, as
    _logit_grads, in one pass (the target columns' weights compared in each tile: no scatter)."""
    T, V = sig_TxV.shape
    t = tuning.fit(T, V)
    tile = pl.BlockSpec((t.rows, t.cols), lambda j, i: (i, j))
    row = pl.BlockSpec((t.rows,), lambda j, i: (i,))
    P = cols_TxP.shape[1]  # one (T,) array per column: Triton's blocks are powers of two, P is not
    call = _pallas(_head_grad_kernel, t, "head_grad", grid=(V // t.cols, T // t.rows),
                   out_shape=jax.ShapeDtypeStruct((T, V), E5M2), in_specs=[tile, row, row] + [row] * (2 * P),
                   out_specs=tile)
    return call(sig_TxV, lse_T, total_T, *(cols_TxP[:, k] for k in range(P)), *(ws_TxP[:, k] for k in range(P)))


# -----------------------------------------------------------------------------
# 3 Optimizer

# One row per parameter (the reference's TrainingManager.param_table). Adam's lr is hp.adam_lr x lr_mul,
# NorMuon's hp.muon_lr x lr_mul x sqrt(max(1, rows/cols)) of its matrices x matrix_lr_muls (cycled
# over the bank's matrices); both x the schedule's lr multiplier (step_values_at multiplies them out).
# wd_mul scales hp.adam_wd / hp.muon_wd.
# split_axis: with several devices, the axis along which they share the optimizer's state and update
# (the reference's "sharded" comms: a bank's matrices, a table's rows, lm_head's columns as embed's
# rows transposed; update_spec); without one, each device updates the whole parameter.
PARAM_TABLE = {
    "qk_bank":             dict(optim="normuon", lr_mul=1.0, wd_mul=1.0, split_axis=0),
    "vo_bank":             dict(optim="normuon", lr_mul=1.0, wd_mul=1.0, split_axis=0),
    "mlp_bank":            dict(optim="normuon", lr_mul=1.0, wd_mul=1.0, split_axis=0,
                                matrix_lr_muls=(1.0, 2.0)),  # viewed as 24 matrices: c_fc, c_proj, c_fc, ...
    "scalars":             dict(optim="adam", betas=(0.9, 0.99), lr_mul=5.0, wd_mul=0.0),
    "smear_gate.weight":   dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.01, wd_mul=0.0),
    "ve_gate_bank":        dict(optim="adam", betas=(0.9, 0.99), lr_mul=1.0, wd_mul=1.0),
    "lm_head.weight":      dict(optim="adam", betas=(0.5, 0.95), lr_mul=1.0, wd_mul=150.0, split_axis=1),
    "bigram_embed.weight": dict(optim="adam", betas=(0.75, 0.95), lr_mul=75.0, wd_mul=5.0, split_axis=0),
    "post_lambdas":        dict(optim="adam", betas=(0.9, 0.95), lr_mul=1.0, wd_mul=0.0),
    "resid_lambdas":       dict(optim="adam", betas=(0.9, 0.95), lr_mul=5.0, wd_mul=0.0),
    "value_embeds":        dict(optim="adam", betas=(0.75, 0.95), lr_mul=75.0, wd_mul=5.0, split_axis=0),
    "embed.weight":        dict(optim="adam", betas=(0.5, 0.95), lr_mul=1.0, wd_mul=150.0, split_axis=0),
    "mudd_w1":             dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.25, wd_mul=1.0),
    "mudd_w2":             dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.25, wd_mul=1.0),
    "mudd_b2":             dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.25, wd_mul=0.0),
    "mudd_gate_w1":        dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.1, wd_mul=1.0),
    "mudd_gate_w2":        dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.1, wd_mul=1.0),
    "mudd_gate_b2":        dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.1, wd_mul=0.0),
    "_mudd_gate_scale":    dict(optim="adam", betas=(0.9, 0.99), lr_mul=0.1, wd_mul=0.0),
}
LM_HEAD, EMBED = "lm_head.weight", "embed.weight"

# (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X: 5 iterations, safety factor 2e-2, cushion 2.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def _mm(x, y):
    """bf16 x @ y with fp32 accumulation (cuBLAS and the reference's Triton kernels), fp32 result."""
    return jnp.matmul(x, y, preferred_element_type=F32)


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def polar_express(G_NxRxC, split=None):
    """Each matrix's approximate polar factor U V^T, in bf16 with the reference's roundings.

    The input is scaled to spectral norm < 1 in fp32 and rounded once (the reference's g.bfloat16()
    fuses into that division under inductor, so g itself is never rounded). Each iteration works on
    the small Gram matrix: A = bf16(X X^T) (wide) or bf16(X^T X) (tall), B = bf16(c A A + b A), then
    X = bf16(a X + B X) (or X B) in one fp32 epilogue, except for matrices of more than 1024 rows
    (split=None decides), where the reference stores X B in bf16 before adding a X.
    """
    rows, cols = G_NxRxC.shape[-2:]
    tall = rows > cols
    split = rows > 1024 if split is None else split
    g = G_NxRxC.astype(F32)
    norm = jnp.sqrt(jnp.sum(g * g, axis=(-2, -1), keepdims=True))
    X = (g / (norm * np.float32(1.02) + np.float32(1e-6))).astype(BF16)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = matmul(_mT(X), X) if tall else matmul(X, _mT(X))
        B = (_mm(A, _mT(A)) * np.float32(c) + A.astype(F32) * np.float32(b)).astype(BF16)
        gemm = matmul if split else _mm  # (split: X B stored in bf16)
        X = (f32(gemm(X, B) if tall else gemm(B, X)) + np.float32(a) * X.astype(F32)).astype(BF16)
    return X


def nesterov(g_NxRxC, buf_NxRxC, momentum):
    """(update, new buffer) in fp32: buf <- lerp(buf, g, 1 - m), update = lerp(g, buf, m), with torch's
    lerp formulas (weight w < 0.5: a + w (b - a); else b + (w - 1)(b - a))."""
    buf = buf_NxRxC + (1 - momentum) * (g_NxRxC - buf_NxRxC)
    return buf + (momentum - 1) * (buf - g_NxRxC), buf


def second_moment_shape(shape_NxRxC) -> tuple:
    """NorMuon's second moment: one value per row of a tall or square matrix, per column of a wide one."""
    n, rows, cols = shape_NxRxC
    return (n, rows, 1) if rows >= cols else (n, 1, cols)


def normuon_variance_reduction(v_NxRxC, second_moment, beta2: float):
    """(bf16 update, new second moment): each row (column) of v divided by the root of its running
    mean square, the matrix then rescaled to keep its Frobenius norm. fp32 math, one rounding."""
    axis = -1 if second_moment.shape[-1] == 1 else -2
    n = v_NxRxC.shape[axis]
    v = v_NxRxC.astype(F32)
    v_mean = jnp.sum(v * v, axis=axis, keepdims=True) / n
    v_norm = jnp.sqrt(jnp.sum(v_mean, axis=(-2, -1), keepdims=True) * n)
    second_moment = second_moment + np.float32(1 - beta2) * (v_mean - second_moment)
    step = jax.lax.rsqrt(jnp.maximum(second_moment, np.float32(1e-10)))
    v_norm_new = jnp.sqrt(jnp.sum(v_mean * n * (step * step), axis=(-2, -1), keepdims=True))
    scale = step * (v_norm / jnp.maximum(v_norm_new, np.float32(1e-10)))
    return (v * scale).astype(BF16), second_moment


def cautious_update_mantissa(p_bf16, mantissa_u16, u, wd, lr):
    """(bf16 weight, uint16 mantissa) after p <- p - [u p >= 0] wd lr p - lr u on the fp32 value whose
    top 16 bits are the bf16 weight and low 16 bits the mantissa; the weight is that value truncated."""
    bits = jax.lax.bitcast_convert_type(p_bf16, jnp.uint16).astype(jnp.uint32) << 16 | mantissa_u16.astype(jnp.uint32)
    p = jax.lax.bitcast_convert_type(bits, F32)
    u = u.astype(F32)
    p = p - p * (u * p >= 0).astype(F32) * wd * lr - u * lr
    bits = jax.lax.bitcast_convert_type(p, jnp.uint32)
    return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), BF16), (bits & 0xFFFF).astype(jnp.uint16)


def normuon_lr_muls(name: str, shape: tuple) -> list:
    """Per-matrix lr multipliers of a bank (Python floats): shape factor x lr_mul x matrix factor."""
    row, (rows, cols) = PARAM_TABLE[name], shape[-2:]
    cycle = row.get("matrix_lr_muls", (1.0,))
    lr_mul = max(1.0, rows / cols) ** 0.5 * row["lr_mul"]
    return [lr_mul * cycle[i % len(cycle)] for i in range(math.prod(shape[:-2]))]


def normuon_update(p, g, s: dict, lr_N, wd, momentum, beta2: float, shard=lambda x: x):
    """One bank's NorMuon step (every matrix on its own): (new bf16 bank, new state). lr_N: per-matrix lr;
    shard(x): where the devices compute the new matrices, before they are gathered."""
    shape = p.shape
    u, buf = nesterov(g.reshape(-1, *shape[-2:]).astype(F32), s["momentum_buffer"], momentum)
    v, second = normuon_variance_reduction(polar_express(u), s["second_momentum_buffer"], beta2)
    p, mantissa = cautious_update_mantissa(p.reshape(u.shape), s["mantissa"], v, wd, lr_N[:, None, None])
    return shard(p).reshape(shape), dict(momentum_buffer=buf, second_momentum_buffer=second, mantissa=mantissa)


def adam_update(p, g, s: dict, row: dict, step_size, wd, hp):
    """One Adam step of a parameter with cautious weight decay (wd on p where the update agrees with p
    in sign), fp32 math, p rounded to its own dtype (bf16 has no master copy). step_size: lr with the
    bias corrections, wd: lr^2 x weight decay (fp32 scalars from step_values_at)."""
    b1, b2 = row["betas"]
    g, p32 = g.astype(F32), p.astype(F32)
    m = s["exp_avg"] * np.float32(b1) + g * np.float32(1 - b1)
    v = s["exp_avg_sq"] * np.float32(b2) + np.float32(1 - b2) * g * g
    u = m / (jnp.sqrt(v) + np.float32(hp.adam_eps)) * step_size
    u = u + p32 * (u * p32 > 0).astype(F32) * wd
    return (p32 - u).astype(p.dtype), dict(exp_avg=m, exp_avg_sq=v)


def accumulate(kept, g):
    """The kept gradient plus a new one in the parameter's dtype (torch's .grad accumulation)."""
    return (kept.astype(F32) + g.astype(F32)).astype(kept.dtype)


def adam_step(params: dict, kept: dict, state: dict, sv: dict, hp, shard=lambda x, axis: x,
              exchange=lambda g, axis: g):
    """Adam on every parameter of `params` from its kept gradients, exchanged (exchange(g, split_axis):
    the devices' kept sums to their mean over the 8 ranks; kept as it is when it holds that mean
    already), with the embedding tied to lm_head while sv['tied']: lm_head's gradient gets embed's
    (transposed; added before the exchange, and embed's not exchanged, as the reference skips it),
    embed becomes lm_head^T and keeps its state; at sv['split'] embed's state becomes lm_head's
    (moments transposed)."""
    tie = LM_HEAD in params and EMBED in params
    kept = dict(kept)
    if tie:
        kept[LM_HEAD] = jnp.where(sv["tied"], accumulate(kept[LM_HEAD], kept[EMBED].swapaxes(-1, -2)), kept[LM_HEAD])
    grads = {n: exchange(g, PARAM_TABLE[n].get("split_axis")) for n, g in kept.items() if not (tie and n == EMBED)}
    if tie:
        grads[EMBED] = jax.lax.cond(sv["tied"], lambda g: jnp.zeros(params[EMBED].shape, g.dtype),
                                    partial(exchange, axis=PARAM_TABLE[EMBED]["split_axis"]), kept[EMBED])
    out = {n: adam_update(p, grads[n], state[n], PARAM_TABLE[n], sv["adam_step_size"][n], sv["adam_wd"][n], hp)
           for n, p in params.items()}
    new_params = {n: shard(o[0], PARAM_TABLE[n].get("split_axis")) for n, o in out.items() if not (tie and n == EMBED)}
    new_state = {n: o[1] for n, o in out.items()}
    if tie:  # while tied, embed is the gathered new lm_head transposed: not gathered itself
        new_params[EMBED] = jax.lax.cond(sv["tied"], lambda: new_params[LM_HEAD].T,
                                         lambda: shard(out[EMBED][0], PARAM_TABLE[EMBED]["split_axis"]))
        lm = new_state[LM_HEAD]
        new_state[EMBED] = {k: jnp.where(sv["split"], lm[k].T,
                                         jnp.where(sv["tied"], state[EMBED][k], new))
                            for k, new in new_state[EMBED].items()}
    return new_params, new_state, jax.tree.map(jnp.zeros_like, kept)


def init_optimizer_state(params: dict, hp, devices: int = 0) -> dict:
    """Fresh state for the parameters of `params` (other entries, e.g. buffers, are ignored): NorMuon
    buffers per bank in its (matrices, rows, cols) view, Adam moments, and the Adam
    gradients kept over even steps: with `devices`, each device's own sums, unexchanged (devices, *shape),
    as the train step keeps them; without, one array holding their mean (optimizer_step's default)."""
    normuon, adam, kept = {}, {}, {}
    for name, p in params.items():
        if name not in PARAM_TABLE:
            continue
        if PARAM_TABLE[name]["optim"] == "normuon":
            shape = (math.prod(p.shape[:-2]), *p.shape[-2:])
            normuon[name] = dict(momentum_buffer=jnp.zeros(shape, F32),
                                 second_momentum_buffer=jnp.zeros(second_moment_shape(shape), F32),
                                 mantissa=jnp.zeros(shape, jnp.uint16))
        else:
            adam[name] = dict(exp_avg=jnp.zeros(p.shape, F32), exp_avg_sq=jnp.zeros(p.shape, F32))
            kept[name] = jnp.zeros((devices, *p.shape) if devices else p.shape, p.dtype)
    return dict(normuon=normuon, adam=adam, kept_grads=kept)


def step_values_at(step: int, hp, first_step: int = 0, shapes: dict | None = None) -> dict:
    """The schedule at a step, as the arrays optimizer_step takes (so one compiled program serves all).
    Each lr and decay factor is a Python float product in the reference's order, rounded to fp32
    once, as the reference fills its fp32 scalars. first_step: where the optimizer state began fresh
    (Adam's bias corrections count the odd steps from there; at an even step, the next odd one's).
    shapes: {name: shape} of the parameters (hp's by default; a bank's shape sets its matrices' lrs)."""
    if not 0 <= first_step <= step:
        raise ValueError(f"first_step {first_step} after step {step}: the optimizer state begins at or before the step")
    split, lr = split_step(hp), lr_mul(step, hp)
    t = step // 2 + 1 - first_step // 2
    muon_lr = hp.muon_lr * lr
    shapes = {n: shape for n, (shape, _) in param_shapes(hp).items()} if shapes is None else shapes
    normuon_lr, normuon_wd, adam_step_size, adam_wd = {}, {}, {}, {}
    for name, shape in shapes.items():
        row = PARAM_TABLE[name]
        if row["optim"] == "normuon":
            normuon_lr[name] = np.array([m * muon_lr for m in normuon_lr_muls(name, shape)], np.float32)
            normuon_wd[name] = np.float32(row["wd_mul"] * hp.muon_wd * muon_lr)
        else:
            (b1, b2), adam_lr = row["betas"], hp.adam_lr * lr * row["lr_mul"]
            adam_step_size[name] = np.float32(adam_lr * ((1 - b2 ** t) ** 0.5 / (1 - b1 ** t)))
            adam_wd[name] = np.float32(adam_lr * adam_lr * hp.adam_wd * row["wd_mul"])
    return dict(momentum=np.float32(muon_momentum(step, hp)), normuon_lr=normuon_lr, normuon_wd=normuon_wd,
                adam_step_size=adam_step_size, adam_wd=adam_wd,
                do_adam=np.bool_(step % 2 == 1), tied=np.bool_(step <= split), split=np.bool_(step == split))


def optimizer_step(params: dict, grads: dict, state: dict, hp, step_values: dict, shard=lambda x, axis: x,
                   exchange=lambda g, axis: g):
    """(new params, new state) after one step: NorMuon on the banks every step; Adam on odd steps
    (sv['do_adam']), on even ones the Adam gradients are kept and added to the next step's. Entries
    of params not in PARAM_TABLE pass through. Jit it with hp static. grads: each bank's mean gradient
    over the 8 ranks (any view of it), each Adam parameter's in its kept gradient's layout; by
    default that mean too, in the train step each device's own sum, exchanged (exchange(g,
    split_axis): to the mean) only when Adam steps, as the reference's ranks do. shard(x,
    split_axis): where the devices compute a new bf16 parameter (update_spec), before it is gathered."""
    sv = step_values
    new_params, new_state = dict(params), dict(state, normuon={})
    for name, s in state["normuon"].items():
        row = PARAM_TABLE[name]
        new_params[name], new_state["normuon"][name] = normuon_update(params[name], grads[name], s,
                                                                      sv["normuon_lr"][name], sv["normuon_wd"][name],
                                                                      sv["momentum"], hp.muon_beta2,
                                                                      partial(shard, axis=row.get("split_axis")))
    kept = {n: accumulate(state["kept_grads"][n], grads[n]) for n in state["adam"]}
    adam_params = {n: params[n] for n in state["adam"]}
    adam_params, new_state["adam"], new_state["kept_grads"] = jax.lax.cond(
        sv["do_adam"], partial(adam_step, hp=hp, shard=shard, exchange=exchange), lambda p, g, s, sv: (p, s, g),
        adam_params, kept, state["adam"], sv)
    return new_params | adam_params, new_state


@partial(jax.jit, static_argnums=2, compiler_options=COMPILER_OPTIONS)
def _first_step_params(params, grads, hp, step_values):
    return optimizer_step(params, grads, init_optimizer_state(params, hp), hp, step_values)[0]


def apply_update(params: dict, grads: dict, hp, step: int) -> dict:
    """The parameters after ONE optimizer step at `step` from fresh optimizer state (the check against
    ref89's `step`): params and grads keyed by the reference's names (any float dtype; grads holds
    embed.weight and lm_head.weight separately, tied up to the split step, untied after it). Entries
    of params that are not parameters (FP8 scales, the bigram sign table) pass through unchanged."""
    dtypes = {n: dtype for n, (_, dtype) in param_shapes(hp).items() if n in params}
    p = {n: jnp.asarray(params[n], dtype) for n, dtype in dtypes.items()}
    g = {n: jnp.asarray(grads[n], dtype) for n, dtype in dtypes.items()}
    return dict(params) | _first_step_params(p, g, hp, step_values_at(step, hp, first_step=step))


# -----------------------------------------------------------------------------
# 4 Data: the 8-GPU record's streams, on any device count. Every step's batch is the 8 rank chunks
# that the record's ranks 0..7 receive (leading axis RANKS); with D devices each takes 8/D of them as
# micro-batches (section 5), so the math is the 8-GPU run's. (The reference's W<8 stream is not: it applies the shard-end rule per micro-batch,
# so after its first shard switch it drifts from the 8-GPU stream; we follow the 8-GPU one.)
#
# Training (BOS-aligned): rank r's chunk is a buffer of exactly T+1 = batch_size/8 + 1 tokens, made of
# documents each starting at a BOS, cut at the stage's max_seq_len and the last one at the buffer's
# end (the rest of a cut document is dropped; the next document starts at the next BOS). Rank r+1
# starts at the first BOS after rank r's last document. inputs = buf[:-1], targets = buf[1:], so a
# document's last target is the next document's BOS. If the 8 chunks do not fit in the BOS left in the
# shard, the whole step's batch moves to the next shard, starting at its first BOS. Files are used once,
# in sorted order. A step's batch size and max_seq_len are those of its stage (from its first step on).
#
# Validation (unaligned): step s reads tokens[pos : pos + val_batch_size + 1] and rank r takes
# tokens[pos + r*Tv : pos + (r+1)*Tv + 1]; pos += val_batch_size. Before each step, if
# pos + val_batch_size + 1 >= len(shard) the next val file starts at pos 0. cu_seqlens are then 0 and
# the BOS positions of the inputs (an empty first document when the chunk starts with BOS: harmless).


# cu_seqlens length per rank chunk of T tokens, the record's table (at its three training T) ...
TRAIN_MAX_NUM_DOCS = {16384: 64, 32768: 96, 49152: 128}

# The shard format that data/shards.py writes: 256 little-endian int32 (magic, version, token count,
# zeros), then the uint16 tokens.
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_BYTES = 20240520, 1, 256 * 4
SHARD_FIX = ("if it is a shard, delete it, then download it again (python data/cached_fineweb10B.py N) or "
             "regenerate it (data/fineweb.py, data/synthetic.py); if not, make --train-files / --val-files match "
             "shards only")


def read_shard_header(path: str) -> int:
    """Check a shard's magic, version and size; its token count."""
    path = os.path.abspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(SHARD_HEADER_BYTES)
    except OSError as e:
        raise DataError(f"cannot read shard {path}: {e.strerror}") from None
    if size < SHARD_HEADER_BYTES or len(head) < SHARD_HEADER_BYTES:
        raise DataError(f"{path} is {size} bytes, shorter than the {SHARD_HEADER_BYTES}-byte shard header: {SHARD_FIX}")
    header = np.frombuffer(head, "<i4")
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


def max_num_docs(T: int) -> int:
    """cu_seqlens entries per chunk of T tokens: the record's table, else next multiple of 128 of T/300.
    Deviation: at least 128, where the reference's formula gives 0 (T < 300, test sizes only)."""
    return TRAIN_MAX_NUM_DOCS.get(T, max(128, -(-(T // 300) // 128) * 128))


class Chunks(NamedTuple):
    """One step's batch: row r is what rank r of the 8-GPU record gets."""
    inputs: np.ndarray  # int32 (8, T)
    targets: np.ndarray  # int32 (8, T)
    cu_seqlens: np.ndarray  # int32 (8, max_num_docs(T)): [0, document ends..., T, T, ...]


class StepDocs(NamedTuple):
    """Where one training step's batch comes from: documents tokens[starts[r][d] : ends[r][d]] of rank r."""
    shard: int  # index into the sorted train files
    tokens: np.ndarray  # that shard's memory map
    starts: list  # RANKS int64 arrays of document starts (BOS positions in the shard)
    ends: list  # ... and their (cut) ends; each rank's lengths sum to T + 1


def doc_cumlens(bos_n: np.ndarray, size: int, max_seq_len: int) -> np.ndarray:
    """int64 (n+1,): C[j] = tokens of documents 0..j-1 of the shard, each cut at max_seq_len."""
    natural_n = np.diff(bos_n, append=size)
    return np.concatenate([[0], np.cumsum(np.minimum(natural_n, max_seq_len))])


def rank_docs(bos_n, cumlen_n1, first: int, T: int):
    """(starts, ends, next first) of the 8 rank chunks taking documents from number `first` on, or None
    when they do not fit in the shard."""
    starts, ends = [], []
    for _ in range(RANKS):
        stop = int(np.searchsorted(cumlen_n1, cumlen_n1[first] + T + 1))  # documents first..stop-1 fill T+1
        if stop >= len(cumlen_n1):
            return None
        lengths = np.diff(cumlen_n1[first:stop + 1])
        lengths[-1] = T + 1 - (cumlen_n1[stop - 1] - cumlen_n1[first])  # the last one is cut at the budget
        starts.append(bos_n[first:stop])
        ends.append(bos_n[first:stop] + lengths)
        first = stop
    return starts, ends, first


def train_docs(hp: Hyperparameters, files: list):
    """Yields the StepDocs of steps 0, 1, 2, ... (the reference's Shard.next_batch at world size 8);
    raises DataError at the step where the files run out."""
    shard, tokens, bos_n, first = -1, np.zeros(0, np.uint16), np.zeros(0, np.int64), 0  # no shard: loads file 0
    step, cumlen_n1, cumlen_key, documents = 0, None, None, 0
    while True:
        stage = hp.stages[stage_of(step, hp)[0]]
        T = stage.batch_size // RANKS
        if cumlen_key != (shard, stage.max_seq_len):  # once per shard and max_seq_len
            cumlen_n1, cumlen_key = doc_cumlens(bos_n, tokens.size, stage.max_seq_len), (shard, stage.max_seq_len)
        found = rank_docs(bos_n, cumlen_n1, first, T)
        if found is None:
            shard += 1
            if shard == len(files):
                if not documents:  # batches are whole documents from a --bos-id on
                    raise DataError(
                        f"the {len(files)} files matching --train-files {os.path.abspath(hp.train_files)!r} hold "
                        f"no --bos-id {hp.bos_id} token, which starts each document: shards of another tokenizer "
                        f"(give its --bos-id and --vocab-size), or not token shards")
                raise DataError(
                    f"the train shards ran out at step {step}: the {len(files)} files matching --train-files "
                    f"{os.path.abspath(hp.train_files)!r} hold {step} of the run's {hp.total_steps} steps; add shards "
                    f"(FineWeb: `python data/cached_fineweb10B.py N` fetches N; the record reads about 410M tokens) "
                    f"or lower --num-scheduled-iterations")
            tokens = open_shard(files[shard])
            bos_n, first = np.flatnonzero(tokens == hp.bos_id), 0
            documents += bos_n.size
            continue
        starts, ends, first = found
        docs = max(len(s) for s in starts)
        if docs >= max_num_docs(T):
            raise DataError(
                f"step {step}: a rank's {T} tokens hold {docs} documents of {files[shard]}, more than the "
                f"{max_num_docs(T) - 1} its cu_seqlens can hold (as in the reference): these documents are far "
                f"shorter than FineWeb's; use other shards")
        yield StepDocs(shard, tokens, starts, ends)
        step += 1


def chunks_of(docs: StepDocs) -> Chunks:
    """The 8 rank chunks of one step's documents (the buffers gathered at once from one window)."""
    lo, hi = int(docs.starts[0][0]), int(docs.ends[-1][-1])
    window = np.asarray(docs.tokens[lo:hi], np.int32)
    starts, ends = np.concatenate(docs.starts), np.concatenate(docs.ends)
    lengths = ends - starts
    T = int(lengths[:len(docs.starts[0])].sum()) - 1
    # position i of the flat (8*(T+1)) buffer comes from window[start of its document - lo + offset in it]
    buf_RxT1 = window[np.repeat(starts - lo - (np.cumsum(lengths) - lengths), lengths)
                      + np.arange(RANKS * (T + 1))].reshape(RANKS, T + 1)
    cu_RxN = np.full((RANKS, max_num_docs(T)), T, np.int32)
    cu_RxN[:, 0] = 0
    for r, (s, e) in enumerate(zip(docs.starts, docs.ends)):
        cu_RxN[r, 1:len(s)] = np.cumsum(e - s)[:-1]  # the last document's end is T (one target short)
    inputs_RxT = np.ascontiguousarray(buf_RxT1[:, :-1])
    return Chunks(inputs_RxT, np.ascontiguousarray(buf_RxT1[:, 1:]), cu_RxN)


def train_chunks(hp: Hyperparameters, files: list = None):
    """Yields the Chunks of training steps 0, 1, 2, ... of the 8-GPU record."""
    files = shard_files(hp.train_files, "--train-files") if files is None else files
    for docs in train_docs(hp, files):
        yield chunks_of(docs)


def val_chunks(hp: Hyperparameters, files: list = None):
    """Yields the Chunks of the val_tokens / val_batch_size validation steps (a fresh pass each call)."""
    files = shard_files(hp.val_files, "--val-files") if files is None else files
    B, Tv, N = hp.val_batch_size, hp.val_batch_size // RANKS, max_num_docs(hp.val_batch_size // RANKS)
    shard, tokens, pos = 0, open_shard(files[0]), 0
    for step in range(hp.val_tokens // B):
        while pos + B + 1 >= tokens.size:
            shard, pos = shard + 1, 0
            if shard == len(files):
                raise DataError(
                    f"the val shards ran out at validation step {step}: the {len(files)} files matching --val-files "
                    f"{os.path.abspath(hp.val_files)!r} hold {step} batches of --val-batch-size {B} (a batch needs "
                    f"{B + 2} tokens left in its file) but --val-tokens {hp.val_tokens} needs {hp.val_tokens // B}")
            tokens = open_shard(files[shard])
        window = np.asarray(tokens[pos:pos + B + 1], np.int32)
        inputs_RxT = window[:-1].reshape(RANKS, Tv)
        rank_b, pos_b = np.nonzero(inputs_RxT == hp.bos_id)  # row-major: grouped by rank, ascending positions
        counts_R = np.bincount(rank_b, minlength=RANKS)
        if counts_R.max() >= N:
            raise DataError(f"validation step {step}: a rank's {Tv} tokens of {files[shard]} hold {counts_R.max()} "
                            f"BOS tokens, more than the {N - 1} its cu_seqlens can hold: use other shards")
        cu_RxN = np.full((RANKS, N), Tv, np.int32)
        cu_RxN[:, 0] = 0
        cu_RxN[rank_b, 1 + np.arange(len(rank_b)) - np.repeat(np.cumsum(counts_R) - counts_R, counts_R)] = pos_b
        yield Chunks(inputs_RxT, window[1:].reshape(RANKS, Tv), cu_RxN)
        pos += B


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
# 5 Training step: one jitted program per stage shape over a 1-D data mesh. A step is the 8-GPU
# reference's: 8 rank chunks of T tokens; each device runs its share of them one after another
# (micro-batches, each its own sequence), with one FP8 activation-scale state per chunk slot, so 1, 2,
# 4 or 8 devices compute the same step (up to the rounding of bf16 sums). Gradients of sum(per-token
# loss) are averaged over the 8 chunks (the reference's reduce AVG with grad scale 1) as the
# reference's ranks exchange them: in the parameter's dtype, the banks' every step, the Adam
# parameters' only on odd steps, when Adam steps (on even ones each device keeps its own); with
# several devices each updates its share of every bank and table (update_spec) and gathers it.


def make_mesh(devices=None):
    devices = jax.devices() if devices is None else devices
    if RANKS % len(devices):
        raise ConfigError(f"{len(devices)} devices: the step's 8 chunks must split evenly, so use 1, 2, 4 or 8 "
                          f"devices per run (e.g. CUDA_VISIBLE_DEVICES)")
    return jax.sharding.Mesh(np.array(devices), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))


def trainable(weights: dict, hp: Hyperparameters) -> dict:
    return {k: weights[k] for k in param_shapes(hp)}


def fp8_state(weights: dict) -> dict:
    """The FP8 down projection's carried state: the next step's weight scales (from this step's
    weights; NaN: none yet) and one activation-scale row per chunk slot."""
    act = weights["_mlp_down_act_scales"]
    return {"next_w": weights["_mlp_down_proj_next_scales"],
            "act": act if act.ndim == 2 else jnp.broadcast_to(act, (RANKS, act.shape[0]))}


def next_act_scales(act_12, amax_11):
    """The reference's delayed activation scale: this forward's amax x 1.8 / 448 (the padding layer kept)."""
    new = jnp.maximum(amax_11, 1e-12) * np.float32(MLP_ACT_HEADROOM / E4M3_MAX)
    return act_12.at[:NUM_LAYERS].set(new)


def device_step(params, buffers, act_Mx12, inputs_MxT, targets_MxT, a, w_scales, prefix_V, attention="xla",
                max_diagonals=None, mlp="xla", head="xla", dc="xla"):
    """This device's chunks one at a time: its gradient sums in each parameter's dtype (a rank's
    gradient, bf16 for bf16 parameters; summed in fp32 over several chunks, the token and bigram
    tables' from their rows' cotangents, rounded once), under a leading axis of one (the devices' sums
    side by side, for exchange_gradient), the summed losses of all devices, new activation scales.
    max_diagonals: the XLA attention's static loop bounds (window_attention), if known."""
    a = with_max_diagonals(a, max_diagonals)

    def chunk(total, xs):
        x_T, y_T, act_12 = xs
        ids = row_ids(params, x_T)
        tables = {name: params[name] for name in ids}

        def loss(p, rows):
            s, losses, amax = sequence_loss({**buffers, **tables, **p}, x_T, y_T, a, True, (w_scales, act_12),
                                            prefix_targets(prefix_V, y_T), attention, mlp, head, rows, dc)
            return s, (losses, amax)

        rest = {name: w for name, w in params.items() if name not in tables}
        rows = {name: tables[name][i] for name, i in ids.items()}
        (_, (losses, amax)), (g, g_rows) = jax.value_and_grad(loss, (0, 1), has_aux=True)(rest, rows)
        sums, loss_sum = total
        # the looked-up tables' gradients as embedding's backward sums them (each row's cotangents in fp32),
        # added to the running sums in place: not a table-sized gradient to add per chunk (1 GB of fp32
        # for the bigram table's alone)
        sums = {name: sums[name] + v.astype(F32) for name, v in g.items()} | {
            name: sums[name].at[i].add(g_rows[name].astype(F32)) for name, i in ids.items()}
        return (sums, loss_sum + jnp.sum(losses).astype(F32)), next_act_scales(act_12, amax)

    zeros = (jax.tree.map(lambda p: jnp.zeros(p.shape, F32), params), jnp.zeros((), F32))
    (g, loss), act = jax.lax.scan(chunk, zeros, (inputs_MxT, targets_MxT, act_Mx12))
    return jax.tree.map(lambda v, p: v.astype(p.dtype)[None], g, params), jax.lax.psum(loss, "dp"), act


def exchange_gradient(mesh, chunks: int, g_DxS, axis):
    """The reference's reduce of one parameter's gradient (AVG): the devices' sums g_DxS (device_step's)
    to their mean over the step's chunks, in g's dtype (bf16 on the wire for bf16 parameters, as the
    reference's), split along `axis` as update_spec lays out the parameter's update (a reduce-scatter),
    else whole on every device (an all-reduce)."""
    spec = update_spec(mesh.size, g_DxS.shape[1:], axis)

    def device(g_1xS):
        if spec == P():
            return jax.lax.psum(g_1xS[0], "dp") / chunks
        return jax.lax.psum_scatter(g_1xS[0], "dp", scatter_dimension=axis, tiled=True) / chunks

    return jax.shard_map(device, mesh=mesh, in_specs=P("dp"), out_specs=spec, check_vma=False)(g_DxS)


def update_spec(devices: int, shape: tuple, axis) -> P:
    """How the devices share an optimizer state array of a parameter with split_axis `axis` (PARAM_TABLE),
    and the computing of its update: split evenly along that axis, so that each device updates its
    share and the new bf16 parameter is gathered (its gradient reduce-scattered to the same split:
    exchange_gradient); whole on every device when there is one device, no axis, or no even split."""
    split = axis is not None and devices > 1 and len(shape) > axis and shape[axis] % devices == 0
    return P(*[None] * axis, "dp") if split else P()


def optimizer_state_specs(opt_state, devices: int):
    """update_spec of every array of init_optimizer_state's {kind: {parameter: ...}} tree; the kept
    gradients (devices, *shape) by device: each device keeps its own."""
    def spec(path, x):
        if path[0].key == "kept_grads":
            if devices > 1 and np.shape(x)[:1] != (devices,):
                raise ValueError(f"kept gradient {path[1].key} of shape {np.shape(x)}: the train step keeps one per "
                                 f"device, so make the state with init_optimizer_state(..., devices={devices})")
            return P("dp") if devices > 1 else P()
        return update_spec(devices, np.shape(x), PARAM_TABLE[path[1].key].get("split_axis"))

    return jax.tree_util.tree_map_with_path(spec, opt_state)


def optimizer_state_shardings(hp: Hyperparameters, mesh):
    """Where init_optimizer_state's arrays of hp's parameters live on the mesh: the train step's layout."""
    params = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in param_shapes(hp).items()}
    specs = optimizer_state_specs(jax.eval_shape(partial(init_optimizer_state, hp=hp, devices=mesh.size), params),
                                  mesh.size)
    return jax.tree.map(partial(NamedSharding, mesh), specs)


def make_train_step(hp: Hyperparameters, mesh):
    """train_step(params, buffers, opt_state, fp8, inputs_8xT, targets_8xT, a, sv, bootstrap, prefix_V)
    -> (params, opt_state, fp8, mean per-token loss). Jit-compiled; one program per stage shape; opt_state
    laid out as optimizer_state_shardings (initial_state's: init_optimizer_state with devices=mesh.size),
    the rest replicated or by chunk. The XLA attention's loops run max_diagonals(hp, shape): the widest
    windows of hp's stages of that shape (`a` from another stage table with wider windows gives NaN, not
    a cut window)."""
    replicated, by_chunk = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    specs = dict(mesh=mesh, in_specs=(P(), P(), P("dp"), P("dp"), P("dp"), P(), P(), P()),
                 out_specs=(P("dp"), P(), P("dp")), check_vma=False)

    def train_step(params, buffers, opt_state, fp8, inputs_8xT, targets_8xT, a, sv, bootstrap, prefix_V):
        w_scales = down_weight_scales(params["mlp_bank"], bootstrap, fp8["next_w"])
        bounds = max_diagonals(hp, (inputs_8xT.shape[1], a["mtp"].shape[0])) if hp.attention == "xla" else None
        step = partial(device_step, attention=hp.attention, max_diagonals=bounds, mlp=hp.mlp, head=hp.head, dc=hp.dc)
        g, loss, act = jax.shard_map(step, **specs)(params, buffers, fp8["act"], inputs_8xT, targets_8xT, a, w_scales,
                                                    prefix_V)
        exchange = partial(exchange_gradient, mesh, inputs_8xT.shape[0])
        grads = {n: exchange(v.reshape(v.shape[0], -1, *v.shape[-2:]), 0) if n in opt_state["normuon"] else v
                 for n, v in g.items()}  # the banks' every step, in NorMuon's view; Adam's when it steps
        next_w = next_down_weight_scales(params["mlp_bank"])

        def split_then_gather(x, axis):  # gathered where computed: inside Adam's branch, so even steps send none
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, update_spec(mesh.size, x.shape, axis)))
            return jax.lax.with_sharding_constraint(x, replicated)

        params, opt_state = optimizer_step(params, grads, opt_state, hp, sv, split_then_gather, exchange)
        return params, opt_state, {"next_w": next_w, "act": act}, loss / inputs_8xT.size

    fp8_shardings = {"next_w": replicated, "act": by_chunk}
    state = optimizer_state_shardings(hp, mesh)
    return jax.jit(train_step, donate_argnums=(0, 2, 3),
                   in_shardings=(replicated, replicated, state, fp8_shardings, by_chunk, by_chunk, replicated,
                                 replicated, replicated, replicated),
                   out_shardings=(replicated, state, fp8_shardings, replicated), compiler_options=COMPILER_OPTIONS)


def step_inputs(step: int, hp: Hyperparameters, first_step: int = 0) -> tuple:
    """The host-side runtime values of a training step: forward schedule, optimizer schedule, bootstrap
    (first_step: where the optimizer state began fresh)."""
    return schedule_values(step, hp), step_values_at(step, hp, first_step), np.bool_(step <= hp.fp8_bootstrap_steps)


def train_steps(weights: dict, token_arrays: list, hp: Hyperparameters, step: int) -> dict:
    """The check API against ref89's `step`: one optimizer step per flat token array (inputs a[:-1],
    targets a[1:], every 8-GPU rank given that array) from step `step` on, fresh optimizer state;
    returns parameters and state buffers by the reference's names, as ref89's `step` writes them."""
    mesh = make_mesh(jax.devices()[:1])
    train_step = make_train_step(hp, mesh)
    params, fp8 = jax.tree.map(jnp.copy, (trainable(weights, hp), fp8_state(weights)))  # the step donates them
    fp8["act"] = fp8["act"][:1]  # eight equal ranks average to one: the step runs one chunk
    buffers = {"bigram_sign_table": weights["bigram_sign_table"]}
    opt_state = init_optimizer_state(params, hp, devices=1)
    prefix_V = jnp.asarray(prefix_table(hp.padded_vocab))
    losses = []
    for s, tokens in enumerate(token_arrays, start=step):
        inputs, targets, _ = padded_sequence(tokens, hp.bos_id)
        inputs, targets = inputs[None], targets[None]
        a, sv, bootstrap = step_inputs(s, hp, first_step=step)
        params, opt_state, fp8, loss = train_step(params, buffers, opt_state, fp8, inputs, targets, a, sv, bootstrap,
                                                  prefix_V)
        losses.append(float(loss) * inputs.shape[1])  # the mean over the T positions: the array's sum
    return {**params, **buffers, **reference_fp8_buffers(params, fp8, fp8["act"][0], s + 1, hp),
            "__losses__": np.array(losses)}


def reference_fp8_buffers(params, fp8, act_12, next_step: int, hp: Hyperparameters) -> dict:
    """The FP8 state as the reference's buffers hold it after its quantize_mlp_fp8 (ref89's npz): the
    weight scales the next forward uses, the ones after them (from the current weights), and the
    activation scales of one rank."""
    used = down_weight_scales(params["mlp_bank"], next_step <= hp.fp8_bootstrap_steps, fp8["next_w"])
    return {"_mlp_down_act_scales": act_12, "_mlp_down_proj_scales": used,
            "_mlp_down_proj_next_scales": next_down_weight_scales(params["mlp_bank"])}


def make_val_step(hp: Hyperparameters, mesh):
    """val_step(params, buffers, inputs_8xT, targets_8xT, a) -> mean per-token validation loss of the step
    (the reference's mean over its 8 ranks of each rank's mean)."""
    def device_val(params, buffers, inputs_MxT, targets_MxT, a):
        def chunk(total, xy):
            _, losses, _ = sequence_loss({**buffers, **params}, xy[0], xy[1], a, False, attention_impl=hp.attention,
                                         dc_impl=hp.dc)
            return total + jnp.mean(losses), None

        total, _ = jax.lax.scan(chunk, jnp.zeros((), F32), (inputs_MxT, targets_MxT))
        return jax.lax.psum(total, "dp") / RANKS

    replicated, by_chunk = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    return jax.jit(jax.shard_map(device_val, mesh=mesh, in_specs=(P(), P(), P("dp"), P("dp"), P()), out_specs=P(),
                                 check_vma=False),
                   in_shardings=(replicated, replicated, by_chunk, by_chunk, replicated), out_shardings=replicated,
                   compiler_options=COMPILER_OPTIONS)


# -----------------------------------------------------------------------------
# 6 Record log: records/<UTC time>_<id>.txt, line-buffered, written by process 0 only.
# Layout: the full source of this file; a line of 100 '='; the environment; '='; the resolved
# hyperparameters as JSON; '='; then compile, step and summary lines. A complete run ends with
# `run complete`; an interrupted one with `interrupted at step N`; a failed one with `stopped: ...`.

RULE = "=" * 100  # records/logs.py has the same rule (a test checks)


def console_print(text: str) -> None:
    """print, where a console that is gone is not the run's error: the reader of a pipe (`| tee`) killed by
    the same Ctrl-C would otherwise stop the run before its record's last lines. Later lines go nowhere."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


class RecordLog:
    """The record file (line-buffered, never overwritten) and the console; only process 0 has one."""

    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "x", buffering=1)  # "x": never overwrite an earlier log

    def write(self, text: str, console_note: str = "") -> None:
        """A line in the record and on the console; console_note (an ETA, say) goes to the console only."""
        self.file.write(text + "\n")
        console_print(text + console_note)

    def close(self):
        self.file.close()


def val_line(step: int, N: int, val_loss: float, train_ms: float) -> str:
    """As the reference prints it (step 0: step_avg over max(step, 1), so 0.00ms, not nan)."""
    return (f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{train_ms:.0f}ms "
            f"step_avg:{train_ms / max(step, 1):.2f}ms")


def train_line(step: int, N: int, train_ms: float) -> str:
    return f"step:{step}/{N} train_time:{train_ms:.0f}ms step_avg:{train_ms / step:.2f}ms"


def summary_line(s: dict) -> str:
    peak = "n/a" if s["peak_memory_mib"] is None else f"{s['peak_memory_mib']:.0f}MiB"
    return (f"summary final_val_loss:{s['final_val_loss']:.4f} train_time:{s['train_time_ms']:.0f}ms "
            f"step_avg:{s['step_avg_ms']:.2f}ms tokens_per_s:{s['tokens_per_s']:.0f} compile_s:{s['compile_s']:.1f} "
            f"peak_memory:{peak}")


ON_DEVICES = "on the devices when it failed: "  # run_steps' note on a device error


def stopped_line(e: Exception) -> str:
    """The log's last line for an error: its first line, and where run_steps says it happened (not the
    notes JAX adds of its own, which span lines)."""
    notes = [n for n in getattr(e, "__notes__", []) if n.startswith(ON_DEVICES)]
    first = str(e).splitlines()[0] if str(e) else ""
    return f"stopped: {type(e).__name__}: {first}" + "".join(f" ({n})" for n in notes)


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
        "Environment: " + " ".join(f"{k}={os.environ.get(k, '')!r}"
                                   for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")),
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
# 7 Training: the schedule's steps with one compiled train program per stage shape, validation every
# val_loss_every steps and at the end (the last with the widened long window).


def enable_compile_cache(cache_dir: str) -> None:
    """JAX's persistent compile cache in cache_dir, for every program however quick to compile, with XLA's
    GEMM autotuning results and its kernel cache ("all"; JAX's default keeps the autotuning alone), where an
    edited copy of this script finds the kernels it shares with earlier programs (README, Hardware notes)."""
    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_persistent_cache_enable_xla_caches", "all")


class CacheHits:
    """with CacheHits() as hits: ... -> hits.count, the programs JAX loaded from its persistent compile
    cache meanwhile (JAX's monitoring event, whichever thread compiles; eager ops count too)."""
    EVENT = "/jax/compilation_cache/cache_hits"

    def __enter__(self):
        self._hits = []  # (list.append: one step, whichever thread calls)
        jax.monitoring.register_event_listener(self._event)
        return self

    @property
    def count(self) -> int:
        return len(self._hits)

    def _event(self, event, **_):
        if event == self.EVENT:
            self._hits.append(event)

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_listener(self._event)


class Interrupted(BaseException):
    """SIGINT/SIGTERM; a BaseException, like KeyboardInterrupt, so no library's `except Exception` eats it."""


class StopRequests:
    """Where a run stops on a signal. train's handler appends the signal's name to `signals`; run_steps asks
    at(step) before each step. One process stops before its next step. Several must stop before the same
    step, or the others wait in that step's collectives for ever; yet each may see the signal at another
    step, or only one may see it. So the first process to see a signal posts "its step + 2" in JAX's
    coordination service, and every process stops before the first step a post names (past the last step:
    they all end the run as usual). Two steps suffice: a process reads step k's loss before it asks at step
    k + 2, that read waits until every process has dispatched step k, and the poster posts first. (A lookup
    a step: 0.26 ms on one machine's loopback, 2 CPU cores, in the host's time, which runs a step ahead.)"""

    PREFIX = "train_gpt/stop/"

    def __init__(self):
        self.signals = []
        self.posted = False

    @staticmethod
    def _board():
        from jax._src import distributed  # the coordination service's key-value store (no public API yet)

        return distributed.global_state.client

    def post(self, step: int, name: str) -> None:
        if not self.posted:
            self._board().key_value_set(f"{self.PREFIX}{jax.process_index()}", f"{step} {name}")
            self.posted = True

    def at(self, step: int):
        """The signal's name if the run stops before this step, else None."""
        if jax.process_count() == 1:
            return self.signals[0] if self.signals else None
        if self.signals:
            self.post(step + 2, self.signals[0])
        posts = sorted((int(at), name) for _, post in self._board().key_value_dir_get(self.PREFIX)
                       for at, name in [post.split()])
        return posts[0][1] if posts and posts[0][0] <= step else None

    def stopped_before_training(self, name: str) -> None:
        """This process stops before its first step (its handler raised at once): the others stop there
        too where they have not begun it. (One that has waits for it in a collective, and fails.)"""
        if jax.process_count() > 1:
            self.post(0, name)


def interruption(e: BaseException):
    """The Interrupted that e is or comes from, else None. The signal handler raises it wherever Python runs
    next, which may be a callback from C code: that code then fails with an exception of its own, caused by
    it (jax 0.11.2, a Ctrl-C while tracing: numpy's SystemError from a dtype's __numpy_dtype__, 2026-11-28)."""
    while e is not None and not isinstance(e, Interrupted):
        e = e.__cause__ or e.__context__
    return e


class TrainClock:
    """Milliseconds of training: runs while steps run, paused for validation."""

    def __init__(self):
        self.done_ms, self.since = 0.0, None

    def ms(self) -> float:
        return self.done_ms + (0.0 if self.since is None else 1000 * (time.perf_counter() - self.since))

    def run(self):
        if self.since is None:
            self.since = time.perf_counter()

    def pause(self) -> float:
        self.done_ms, self.since = self.ms(), None
        return self.done_ms


def eta_note(tokens_S, steps_done: int, train_ms: float, validations_left: int, val_s: float) -> str:
    """Time left: the steps left at the run's time per token so far (tokens_S: each step's batch; a
    last-stage step holds 3x a first-stage one in the record), and the validations at the last one's."""
    seconds = train_ms / 1000 * tokens_S[steps_done:].sum() / tokens_S[:steps_done].sum() + validations_left * val_s
    return f"  (ETA {seconds / 60:.1f} min)" if seconds >= 1 else ""


def local_value(x) -> float:
    """A replicated scalar's value from this process's own copy (other processes' are not addressable)."""
    return float(x.addressable_data(0))


@dataclasses.dataclass
class Inputs:
    """What a run reads, checked before anything is compiled or written."""
    train_files: list
    val_batches: list  # the validation steps' chunks, this process's rows: (inputs, targets) numpy pairs
    rows: np.ndarray  # this process's chunk rows (of the step's 8)


def local_rows(mesh) -> np.ndarray:
    """The chunk rows (of each step's 8) that this process's devices hold under P('dp')."""
    index = NamedSharding(mesh, P("dp")).addressable_devices_indices_map((RANKS,))
    return np.array(sorted({r for idx in index.values() for r in range(RANKS)[idx[0]]}))


def check_inputs(hp: Hyperparameters, mesh, init_path: str = None, save_path: str = None) -> Inputs:
    """Raises ConfigError/DataError, naming the flag and the fix, before any work is done."""
    rows = local_rows(mesh)
    gpt2_vocab()
    train_files = shard_files(hp.train_files, "--train-files")
    val_files = shard_files(hp.val_files, "--val-files")
    if both := sorted(set(map(os.path.realpath, train_files)) & set(map(os.path.realpath, val_files))):
        raise ConfigError(f"{both[0]} matches both --train-files {hp.train_files!r} and --val-files "
                          f"{hp.val_files!r}: the run would train on its validation data; give --train-files a "
                          f"pattern of the train shards alone (e.g. DIR/*_train_*.bin)")
    reached = 0  # the train shards the run's steps read (FineWeb's 103 are 20 GB; the record reads 5)
    for _, docs in zip(range(hp.total_steps), train_docs(hp, train_files)):  # DataError where they run out
        reached = docs.shard + 1
    for path in train_files[:reached] + val_files:  # an embedding lookup past the table would silently clamp
        tokens = open_shard(path)
        largest = int(tokens.max()) if tokens.size else -1
        if largest >= hp.vocab_size:
            raise DataError(f"{os.path.abspath(path)} holds token id {largest}, but --vocab-size is "
                            f"{hp.vocab_size}: raise --vocab-size (GPT-2 shards need {BOS + 1}) or use other shards")
    val_batches = [(c.inputs[rows], c.targets[rows]) for c in val_chunks(hp, val_files)]
    if init_path and not os.path.isfile(init_path):
        raise DataError(f"--init-weights {os.path.abspath(init_path)!r} is not a file")
    # last: the only check that creates; process 0 writes the log and the weights, every process its cache
    check_outputs(hp.records_dir, save_path, hp.compile_cache_dir, create=True, writer=jax.process_index() == 0)
    return Inputs(train_files, val_batches, rows)


def check_outputs(records_dir: str, save_path: str = None, cache_dir: str = "", create: bool = False,
                  writer: bool = True) -> None:
    """Raises ConfigError unless the log's folder (and --save-weights' file's, and the compile cache's)
    can be written: made now (create, a run) or only looked at (--check: the nearest existing folder
    must let it be made). (JAX would only warn at each program it cannot cache, and compile them all.)
    writer False: a process that writes neither log nor weights (all but process 0): its cache alone."""
    if not writer:
        records_dir = save_path = None
    elif save_path and (os.path.isdir(save_path) or save_path.endswith(os.sep)):
        raise ConfigError(f"--save-weights {os.path.abspath(save_path)!r} is a folder: give a file name (.npz)")
    elif not records_dir:
        raise ConfigError("--records-dir is empty: give the folder for the run's log, e.g. records")
    for path, flag in [(records_dir, "--records-dir"),
                       (os.path.dirname(os.path.abspath(save_path)) if save_path else None, "--save-weights"),
                       (cache_dir or None, "--compile-cache-dir")]:
        if path is None:
            continue
        path = existing = os.path.abspath(path)
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        if os.path.islink(existing) and not os.path.exists(existing):
            problem = f"{existing} is a broken link"
        elif not os.path.isdir(existing):
            problem = f"{existing} is a file, not a folder"
        elif create:
            try:
                os.makedirs(path, exist_ok=True)
                problem = None if os.access(path, os.W_OK) else "not writable"
            except OSError as e:
                problem = e.strerror
        else:
            problem = None if os.access(existing, os.W_OK | os.X_OK) else f"{existing} is not writable"
        if problem:
            raise ConfigError(f"cannot write to {flag} folder {path!r} ({problem}): choose a writable folder")


def initial_state(hp: Hyperparameters, mesh, weights: dict = None):
    """(params, buffers, optimizer state, FP8 state) on the mesh: from weights (load_weights'), or seeded."""
    replicated, by_chunk = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    weights = init_params(hp, hp.seed) if weights is None else weights
    params = jax.device_put(trainable(weights, hp), replicated)
    buffers = jax.device_put({"bigram_sign_table": weights["bigram_sign_table"]}, replicated)
    fp8 = fp8_state(weights)
    fp8 = {"next_w": jax.device_put(fp8["next_w"], replicated), "act": jax.device_put(fp8["act"], by_chunk)}
    opt_state = jax.jit(partial(init_optimizer_state, hp=hp, devices=mesh.size),
                        out_shardings=optimizer_state_shardings(hp, mesh))(params)
    return params, buffers, opt_state, fp8


def program_shape(s: Stage) -> tuple:
    """What makes a stage's train program differ: chunk length and the number of MTP weights."""
    return s.batch_size // RANKS, len(s.mtp_start)


def stage_shape(step: int, hp: Hyperparameters) -> tuple:
    return program_shape(hp.stages[stage_of(step, hp)[0]])


def max_diagonals(hp: Hyperparameters, shape: tuple):
    """(short, long): the most key-block diagonals the windows of the stages of this program shape need,
    or None for a shape of no stage (the XLA attention then counts at runtime)."""
    windows = [s.windows for s in hp.stages if program_shape(s) == shape]
    return tuple(max(_num_diagonals(w[i] * BLOCK) for w in windows) for i in (0, 1)) if windows else None


def with_max_diagonals(a: dict, max_diagonals) -> dict:
    """The runtime schedule values `a` with the XLA attention's static loop bounds (attention() reads
    them), when there are any."""
    return {**a, "max_diagonals": max_diagonals} if max_diagonals is not None else a


def program_steps(hp: Hyperparameters) -> list:
    """The first step of each stage whose train program is new (a stage shape not seen before), in order."""
    firsts, shapes = [], set()
    for first, _ in stage_bounds(hp):
        if stage_shape(first, hp) not in shapes:
            shapes.add(stage_shape(first, hp))
            firsts.append(first)
    return firsts


VAL_KEYS = ("window_short", "window_long", "freq", "scale", "bos")  # the forward values validation reads


def shape_of(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


def lower_steps(hp: Hyperparameters, mesh, params, buffers, opt_state, fp8, prefix_V):
    """{stage shape: lowered train program} and the lowered validation program (traced, not compiled).
    The arguments may be arrays or their shapes (jax.ShapeDtypeStruct); the step's schedule values
    go in as shapes, so a program lowers for devices this process has none of (tests/gpu/aot.py)."""
    train_step = make_train_step(hp, mesh)
    programs = {stage_shape(first, hp): trace_train_step(hp, mesh, first, params, buffers, opt_state, fp8, prefix_V,
                                                         train_step).lower() for first in program_steps(hp)}
    by_chunk = NamedSharding(mesh, P("dp"))
    val_batch = jax.ShapeDtypeStruct((RANKS, hp.val_batch_size // RANKS), jnp.int32, sharding=by_chunk)
    a = {k: shape_of(v) for k, v in schedule_values(0, hp).items() if k in VAL_KEYS}
    return programs, make_val_step(hp, mesh).lower(params, buffers, val_batch, val_batch, a)


def trace_train_step(hp: Hyperparameters, mesh, first: int, params, buffers, opt_state, fp8, prefix_V,
                     train_step=None):
    """The train program of step `first`'s stage shape, traced (.lower() lowers it; bench.py's profile
    wants one alone)."""
    train_step = make_train_step(hp, mesh) if train_step is None else train_step
    by_chunk = NamedSharding(mesh, P("dp"))
    batch = jax.ShapeDtypeStruct((RANKS, stage_shape(first, hp)[0]), jnp.int32, sharding=by_chunk)
    a, sv, bootstrap = jax.tree.map(shape_of, step_inputs(first, hp))
    return train_step.trace(params, buffers, opt_state, fp8, batch, batch, a, sv, bootstrap, prefix_V)


def compile_steps(hp: Hyperparameters, mesh, params, buffers, opt_state, fp8, prefix_V):
    """{stage shape: compiled train program}, the compiled validation program, and how many of these
    the persistent cache gave; ahead of time, all at once: a thread each, as XLA compiles one program
    on about one core (JAX lets go of the GIL)."""
    programs, val_step = lower_steps(hp, mesh, params, buffers, opt_state, fp8, prefix_V)
    pool = ThreadPoolExecutor(len(programs) + 1)
    try:
        with CacheHits() as hits:  # (not around the tracing: its eager ops compile too)
            *compiled, val_compiled = pool.map(lambda lowered: lowered.compile(), [*programs.values(), val_step])
    finally:  # an interrupt goes on at once, not after the other compiles (they end on their own)
        pool.shutdown(wait=False, cancel_futures=True)
    return dict(zip(programs, compiled)), val_compiled, hits.count


def run_steps(hp: Hyperparameters, say, console, programs, val_step, state, batches, val_batches, prefix_V,
              stop: StopRequests = None):
    """The schedule: total_steps steps, validation every val_loss_every steps and at the end. Writes
    the step and val lines; returns (state, final val loss, train ms). A signal (`stop`, which train's
    handler tells) ends it before a step as an Interrupted, which gets that step (.step)."""
    stop = stop or StopRequests()
    N = hp.total_steps
    params, buffers, opt_state, fp8 = state
    validations = [s for s in range(N + 1) if s == N or (hp.val_loss_every and s % hp.val_loss_every == 0)]
    val_steps_before_last = (hp.intermediate_val_tokens or hp.val_tokens) // hp.val_batch_size
    tokens_S = np.array([hp.stages[stage_of(s, hp)[0]].batch_size for s in range(N)], np.float64)
    # Step s's loss is read only once step s + 1 is dispatched, so the devices never wait for the host.
    clock, pending, val_s, step = TrainClock(), None, 0.0, 0
    on_device = []  # what was dispatched and not yet read back: step indices, or "validation"

    def finish(dispatched, pause=False):
        finished, loss = dispatched
        loss = local_value(loss)  # waits for that step
        on_device.remove(finished)
        ms = clock.pause() if pause else clock.ms()  # paused before the line is written: writing is not training
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"non-finite train loss {loss} at step {finished + 1}: usual causes are a learning rate too "
                f"high for this batch or model (--muon-lr, --adam-lr, ...) and bad data (check the shards)")
        left = [v for v in validations if v > finished]
        say(train_line(finished + 1, N, ms), eta_note(tokens_S, finished + 1, ms, len(left), val_s))

    try:
        for step in range(N + 1):
            signal_name = stop.at(step)
            if signal_name:
                if pending:  # the step on the devices gets its line: the log's last step line is the step named
                    finish(pending)
                raise Interrupted(signal_name)
            if step in validations:
                if pending:
                    finish(pending, pause=True)
                    pending = None
                on_device.append("validation")
                clock.pause()
                some = val_batches if step == N else val_batches[:val_steps_before_last]
                if step == validations[0] or step == N and len(some) > val_steps_before_last:
                    console(f"validating on {len(some) * hp.val_batch_size} tokens ...")
                t = time.perf_counter()
                a = {k: v for k, v in schedule_values(step, hp, final_val=step == N).items() if k in VAL_KEYS}
                losses = [val_step(params, buffers, x, y, a) for x, y in some]  # all dispatched, then read
                val_loss = float(np.mean([local_value(v) for v in losses]))
                on_device.remove("validation")
                val_s = time.perf_counter() - t
                say(val_line(step, N, val_loss, clock.ms()))
                if not math.isfinite(val_loss):
                    raise FloatingPointError(f"non-finite val loss {val_loss} at step {step}: usual causes are a "
                                             f"learning rate too high and bad data")
            if step == N:
                return (params, buffers, opt_state, fp8), val_loss, clock.ms()
            x, y = next(batches)
            a, sv, bootstrap = step_inputs(step, hp)
            clock.run()
            on_device.append(step)
            params, opt_state, fp8, loss = programs[stage_shape(step, hp)](params, buffers, opt_state, fp8, x, y, a,
                                                                           sv, bootstrap, prefix_V)
            if pending:
                finish(pending)
            pending = (step, loss)
    except Interrupted as e:
        e.step = step
        raise
    except (FloatingPointError, DataError):  # (their messages say where)
        raise
    except Exception as e:  # a device error surfaces at the next wait, maybe from a later step: name those running
        firsts = program_steps(hp)
        running = [f"the validation at step {step}" if s == "validation" else
                   f"step {s + 1} (stage {stage_of(s, hp)[0]}{', its program run for the first time' * (s in firsts)})"
                   for s in on_device]
        e.add_note(ON_DEVICES + (" and ".join(running) or "nothing"))
        raise


def train(hp: Hyperparameters, preset: str, mesh, init_path: str = None, save_path: str = None) -> dict:
    """Run the whole speedrun; returns the summary. Bad input raises ConfigError/DataError before
    anything is written; the record log is opened once the steps are compiled."""
    main_process = jax.process_index() == 0

    def console(text):
        if main_process:
            console_print(text)

    previous, log, batches, trained, stop = {}, None, None, False, StopRequests()
    # may an error leave at once (leave_at_once): from the input checks' end to the last step, but not while
    # compiling: os._exit would cut short a persistent-cache entry another compile thread is writing, and the
    # others, stopped by the coordination service, process 0's (the one process JAX lets write the cache; it
    # writes an entry in place, and one cut short is read back with a warning and compiled anew in every run)
    may_leave, leaving = False, None

    def interrupt(signum, frame):  # runs in the main thread, between Python bytecodes
        """Before training, stop at once; once the data thread runs, between steps (run_steps asks
        `stop`): an exception raised inside JAX's own code could leave it holding a lock the data
        thread then waits for, and the clean-up's join would hang."""
        name = signal.Signals(signum).name
        stop.signals.append(name)
        if batches is None:
            raise Interrupted(name)

    def say(text, console_note=""):
        if log:
            log.write(text, console_note)

    def unraisable(info):  # the handler's exception raised in a callback whose caller only prints it: stop has it
        if not isinstance(info.exc_value, Interrupted):
            unraisable_before(info)

    unraisable_before, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        console("checking shards and flags ...")
        inputs, weights = checked_everywhere(lambda: (check_inputs(hp, mesh, init_path, save_path),
                                                      load_weights(init_path, hp) if init_path else None))
        may_leave = jax.process_count() > 1
        by_chunk, replicated = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P())
        state = initial_state(hp, mesh, weights)
        del weights  # the host copy (2.6 GB for the record): the devices hold theirs
        prefix_V = jax.device_put(prefix_table(hp.padded_vocab), replicated)
        console(f"compiling the train and validation steps (persistent cache: {hp.compile_cache_dir or 'off'}) ...")
        t0 = time.perf_counter()
        may_leave = False
        programs, val_step, loaded = compile_steps(hp, mesh, *state, prefix_V)
        may_leave = jax.process_count() > 1
        compile_s = time.perf_counter() - t0
        if stop.signals:  # the handler's exception, raised in a callback whose caller only printed it (a gc
            raise Interrupted(stop.signals[0])  # callback of jax's, "Exception ignored in": 2 loaded cores)

        if main_process:
            log = RecordLog(new_log_path(hp.records_dir))
            console_print(f"record log: {os.path.abspath(log.path)}")  # records/attempt.py finds the log by it
            log_header(log, hp, preset)
        say(f"preset {preset}: {hp.total_steps} steps ({hp.num_scheduled_iterations} scheduled + "
            f"{hp.num_extension_iterations} extension), stages at {[b[0] for b in stage_bounds(hp)]}, batch "
            f"{[s.batch_size for s in hp.stages]} tokens as 8 chunks, {mesh.size} device(s), "
            f"{RANKS // mesh.size} chunk(s) per device per step, attention {hp.attention}, dc {hp.dc}, mlp {hp.mlp}, "
            f"head {hp.head}; log {log.path if log else '-'}")
        if init_path:
            say(f"initial weights: {os.path.abspath(init_path)}")
        plural = "s" * (len(programs) > 1)
        cache = (f"{hp.compile_cache_dir}, {loaded} of {len(programs) + 1} loaded from it" if hp.compile_cache_dir
                 else "off")
        say(f"compile: {compile_s:.1f}s for {len(programs)} train program{plural} and the validation step "
            f"(persistent cache: {cache})")

        def put(chunks):
            return tuple(jax.make_array_from_process_local_data(by_chunk, a[inputs.rows])
                         for a in (chunks.inputs, chunks.targets))

        val_batches = [tuple(jax.make_array_from_process_local_data(by_chunk, a) for a in b) for b in inputs.val_batches]
        batches = prefetch(train_chunks(hp, inputs.train_files), put)
        state, val_loss, train_ms = run_steps(hp, say, console, programs, val_step, state, batches, val_batches,
                                              prefix_V, stop)
        trained = True
        stats = jax.local_devices()[0].memory_stats() or {}
        tokens = sum(hp.stages[stage_of(s, hp)[0]].batch_size for s in range(hp.total_steps))
        summary = {
            "final_val_loss": val_loss,
            "train_time_ms": train_ms,
            "step_avg_ms": train_ms / hp.total_steps,
            "tokens_per_s": tokens / (train_ms / 1000),
            "compile_s": compile_s,
            "peak_memory_mib": stats["peak_bytes_in_use"] / 2**20 if "peak_bytes_in_use" in stats else None,
            "log": log.path if log else None,
        }
        say(summary_line(summary))
        if save_path and main_process:
            save_weights(final_weights(state, hp), save_path)
            say(f"weights saved: {os.path.abspath(save_path)}")
        say("run complete")
        synthetic = any(os.path.basename(f).startswith("synthetic_") for f in inputs.train_files)
        console(f"the record log: {log.path if log else '-'} (`python records/logs.py LOG` prints its table)"
                + ("; trained on synthetic shards: the losses say nothing about FineWeb" if synthetic else ""))
    except FloatingPointError as e:
        say(f"stopped: {e}")
        raise
    except (Interrupted, Exception) as e:
        interrupted = interruption(e)
        if interrupted is None:  # a bug or a device error: the log says so, the traceback goes on
            if may_leave and not trained:  # maybe in this process alone, while the others wait for it in a
                leaving = e  # collective (once trained, none is left): even if the log cannot take its line
            say(stopped_line(e))
            raise
        if batches is None:  # the handler raised at once
            stop.stopped_before_training(str(interrupted))
        if log:
            say(f"interrupted at step {getattr(interrupted, 'step', hp.total_steps if trained else 0)} ({interrupted})")
        else:
            console(f"interrupted ({interrupted}) before training started; no record log was written")
        raise interrupted from None
    finally:
        for s in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        try:
            if batches is not None:
                batches.close()
        finally:
            try:
                if log:
                    log.close()
            finally:
                if leaving is not None:  # with the signals still ignored: nothing may hold it up short of its exit
                    leave_at_once(leaving)
                for s, handler in previous.items():
                    signal.signal(s, handler)
                sys.unraisablehook = unraisable_before
    return summary


def final_weights(state, hp: Hyperparameters) -> dict:
    """Parameters and state buffers by the reference's names (rank 0's activation scales), for save_weights."""
    params, buffers, _, fp8 = state
    act = np.asarray(fp8["act"].addressable_data(0))[0]  # row 0 lives on process 0's first device
    return {**params, **buffers, **reference_fp8_buffers(params, fp8, act, hp.total_steps, hp)}


# -----------------------------------------------------------------------------
# 8 Several processes or hosts: jax.distributed with the coordinator given by flags or JAX_*
# environment variables, or detected from SLURM / Open MPI (then one process per GPU, JAX's rule). One
# process per host (all its GPUs) or one per GPU both work: the mesh spans every process's devices, and
# each process reads every step's batch and puts its own chunks on its devices.


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
        # deactivate: JAX's cluster detection would otherwise, inside a SLURM or Open MPI job, give each process
        # only the GPU of its local rank; a process given its peers by hand uses every GPU it sees
        return {**given, "heartbeat_timeout_seconds": args.heartbeat_timeout, "cluster_detection_method": "deactivate"}
    if int(os.environ.get("SLURM_NTASKS", 1)) > 1 or int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1)) > 1:
        # JAX reads the cluster's variables: one process per GPU, the GPU of the process's local rank
        return {"heartbeat_timeout_seconds": args.heartbeat_timeout}
    return None


def start_distributed(settings) -> None:
    if settings is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes (tests); GPUs use NCCL
    jax.distributed.initialize(**settings)


def checked_everywhere(check):
    """check()'s result once every process's input checks have passed: a process whose checks end
    otherwise (bad input, a signal, a bug) raises its own exception, and the others an error that names
    it, at once. (Alone, the others would wait at the first collective, placing the weights on the
    devices, while the stopped process waited in JAX's shutdown: up to 5 minutes.)"""
    try:
        result, error = check(), None
    except BaseException as e:  # re-raised below, once every process knows
        result, error = None, e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        failed = np.flatnonzero(multihost_utils.process_allgather(np.int32(error is not None)))
        if error is None and failed.size:
            raise ConfigError(f"process {', '.join(map(str, failed))} stopped during its input checks (its own "
                              f"output says why), so every process stops")
    if error is not None:
        raise error
    return result


def leave_at_once(e: Exception) -> None:
    """Ends a process of a multi-process run whose training failed between the input checks and the last step
    (a bug, a device error, a shard gone: maybe in this process alone) with main's message for e and exit
    code, without JAX's shutdown: its barrier would hold this process for 5 minutes while the others wait in
    a collective for it (two processes on CPU: both ended after 301 s). Gone, it is missed by the coordination
    service, which stops the others (SIGABRT, with JAX's message) within --heartbeat-timeout seconds, at once
    when it was process 0, which hosts the service; some collectives fail sooner (gloo's, placing the
    weights: a peer's closed connection).
    Not while compiling: train() keeps to the ordinary exit there (its comment says why)."""
    bad_input = isinstance(e, (ConfigError, DataError))
    try:  # (a closed stderr must not keep it from its exit)
        if bad_input:
            print(f"error: {e}", file=sys.stderr)
        else:
            traceback.print_exception(e)
        print(f"process {jax.process_index()} stops at once; the others stop when their collective fails or the "
              f"coordination service misses it (--heartbeat-timeout)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(2 if bad_input else 1)


def assert_same_everywhere(hp: Hyperparameters, preset: str) -> None:
    """Every process must train the same configuration (else the compiled programs differ and hang); each
    host's own folders (the log's, which only process 0 writes; the compile cache, under each $HOME) may differ."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        trained = dataclasses.replace(hp, records_dir="", compile_cache_dir="")
        digest = np.frombuffer(uuid.uuid5(uuid.NAMESPACE_OID, preset + repr(trained)).bytes, np.uint8)
        multihost_utils.assert_equal(digest, "processes were started with different hyperparameters")


# -----------------------------------------------------------------------------
# 9 Command line: every scalar Hyperparameters field is a flag (--num-scheduled-iterations 200, ...);
# the stage table comes from the preset, its batch sizes and document lengths also from two flags.


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # a one-line usage, not all 40 options: the error stays in view
        self.exit(2, f"usage: {self.prog} [options]  (--help lists them)\n{self.prog}: error: {message}\n")


def parse_args(argv=None):
    parser = ArgumentParser(  # no abbreviations: run.sh and attempt.py look for whole flags
        description="Train the record-89 GPT (modded-nanogpt speedrun) in JAX on all local devices.", allow_abbrev=False,
    )
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="named configuration; default: record when a GPU is present, else cpu")
    parser.add_argument("--init-weights", metavar="PATH", help="start from these weights (.npz as --save-weights or "
                        "ref89.py init writes them) instead of the seed's initialisation")
    parser.add_argument("--save-weights", metavar="PATH", help="after the run, save the trained weights and state "
                        "buffers to PATH (.npz keyed by the PyTorch reference's names)")
    parser.add_argument("--check", action="store_true", help="check the options and that the output folders can be "
                        "written, then exit (run.sh does so before its data work; shards and weight files are checked "
                        "when a run starts)")
    launch = parser.add_argument_group("multi-process launch (also JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                                       "JAX_PROCESS_ID; SLURM and Open MPI are detected)")
    launch.add_argument("--coordinator-address", help="host:port of process 0")
    launch.add_argument("--num-processes", type=int)
    launch.add_argument("--process-id", type=int)
    launch.add_argument("--heartbeat-timeout", type=int, default=100,
                        help="seconds after which a silent process counts as dead and the others stop (100)")
    hyper = parser.add_argument_group("hyperparameters (defaults: those of the chosen preset)")
    notes = field_notes()
    for field in FLAG_FIELDS:
        flag = "--" + field.name.replace("_", "-")
        if field.name in AUTO_FIELDS:
            what = {"attention": "the windowed attention: pure JAX, or fused Pallas kernels",
                    "dc": "layer 10's DC correction: pure JAX, or fused Pallas kernels",
                    "mlp": "the FP8 MLP's up projection and backward dpre: XLA's GEMMs and passes, or Pallas GEMM "
                           "kernels with fused epilogues",
                    "head": "the FP8 head's softcapped cross-entropy over cuBLAS's logits: XLA's passes, or Pallas "
                            "kernels with the reference's fast exp"}[field.name]
            hyper.add_argument(flag, choices=("auto", "xla", "pallas"),
                               help=f"{what}; auto (default): " + (
                                   "pallas on GPUs, xla elsewhere (Pallas interprets, slowly)"
                                   if AUTO_ON_GPU[field.name] == "pallas" else
                                   "xla everywhere for now (its Pallas kernels await a GPU run that checks and times "
                                   f"them: AUTO_ON_GPU; {flag} pallas takes them)"))
            continue
        defaults = f"(record: {getattr(PRESETS['record'], field.name)}, cpu: {getattr(PRESETS['cpu'], field.name)})"
        defaults = f"{notes[field.name]} {defaults}".replace("%", "%%") if field.name in notes else defaults
        if field.type in (bool, "bool"):
            hyper.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None,
                               help=defaults)
        else:
            hyper.add_argument(flag, dest=field.name, type=field.type, default=None, help=defaults)
    stages = parser.add_argument_group("stage table (defaults: the preset's; four values: stages 0-2 and the extension)")

    def table(column):
        return "; ".join(f"{name}: " + ",".join(str(column(s)) for s in PRESETS[name].stages)
                         for name in ("record", "cpu"))

    stages.add_argument("--stage-batch-sizes", metavar="B0,B1,B2,B3",
                        help=f"tokens per step over the 8 reference ranks ({table(lambda s: s.batch_size)})")
    stages.add_argument("--stage-max-seq-lens", metavar="L0,L1,L2,L3",
                        help=f"documents are cut at this length ({table(lambda s: s.max_seq_len)})")
    stages.add_argument("--stage-mtp-terms", metavar="N0,N1,N2,N3", help="multi-token-prediction terms: each stage "
                        f"keeps the first N of its MTP weights ({table(lambda s: len(s.mtp_start))}; 1,1,1,1: next "
                        f"token only, and stages of one batch size share a train program)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = (" (they look like shard files: the shell expanded an unquoted glob; quote it, e.g. "
                "--train-files 'data/fineweb10B/fineweb_train_*.bin')") if unknown[0].endswith(".bin") else ""
        flags = [f for action in parser._actions for f in action.option_strings if f.startswith("--")]
        near = {arg: difflib.get_close_matches(  # misspelled flags (--no-x: only among the --no- ones)
                    arg.split("=")[0], [f for f in flags if f.startswith("--no-") == arg.startswith("--no-")], 2, 0.75)
                for arg in unknown if arg.startswith("--")}
        hint += "".join(f" (did you mean {' or '.join(m)} for {arg}?)" for arg, m in near.items() if m)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    overrides = {f.name: getattr(args, f.name) for f in FLAG_FIELDS if getattr(args, f.name) is not None}
    for name in AUTO_FIELDS:  # main's to resolve (auto_implementation)
        if overrides.get(name) == "auto":
            del overrides[name]
    return args, overrides


def stage_flag_values(args, flag: str, now: list):
    """The four integers of a stage-table flag (None when not given); `now`: the table's current ones."""
    text = getattr(args, flag[2:].replace("-", "_"))
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != len(now):
        raise ConfigError(f"{flag} {text!r}: give {len(now)} comma-separated integers (stages 0-2 and the "
                          f"extension), e.g. {','.join(map(str, now))}")
    return values


def with_stage_flags(hp: Hyperparameters, args) -> Hyperparameters:
    """hp with the stage table's batch sizes, document lengths and MTP terms from --stage-batch-sizes,
    --stage-max-seq-lens and --stage-mtp-terms."""
    stages = list(hp.stages)
    for flag, field in [("--stage-batch-sizes", "batch_size"), ("--stage-max-seq-lens", "max_seq_len")]:
        values = stage_flag_values(args, flag, [getattr(s, field) for s in stages])
        if values:
            stages = [dataclasses.replace(s, **{field: v}) for s, v in zip(stages, values)]
    terms = stage_flag_values(args, "--stage-mtp-terms", [len(s.mtp_start) for s in stages])
    if terms:
        bad = [f"stage {k} has {len(s.mtp_start)}" for k, (s, n) in enumerate(zip(stages, terms))
               if not 1 <= n <= len(s.mtp_start)]
        if bad:
            raise ConfigError(f"--stage-mtp-terms {args.stage_mtp_terms!r}: a stage keeps 1 up to its number of MTP "
                              f"weights ({', '.join(bad)})")
        stages = [dataclasses.replace(s, mtp_start=s.mtp_start[:n], mtp_end=s.mtp_end[:n])
                  for s, n in zip(stages, terms)]
    return dataclasses.replace(hp, stages=tuple(stages))


FLAG_FIELDS = [f for f in dataclasses.fields(Hyperparameters) if f.name != "stages"]


def field_notes() -> dict:
    """Each Hyperparameters field's comment in this file (`name: type = default  # note`): its --help."""
    fields = SOURCE.partition("class Hyperparameters:")[2].partition("\n    def ")[0]  # (none in an edited copy: {})
    return dict(re.findall(r"^    (\w+): .*?  # (.*)$", fields, re.M))


# The share of each GPU's memory JAX takes for its pool (XLA_PYTHON_CLIENT_MEM_FRACTION; the user's value
# wins). At JAX's 75%, one H100 running the record preset stopped at its last stage's first step: a small
# buffer left in the pool during stage 1 split the 61 GB free so that the last stage's 32.3 GiB of
# temporaries found no range in one piece (2026-11-27; out of memory with 53 GB free in two ranges of 22
# and 31 GB). At 90% the range after that buffer holds it.
GPU_MEMORY_FRACTION = "0.90"
# XLA flags every run starts with, unless XLA_FLAGS names the flag (the user's value wins). XLA's own
# Triton GEMMs off, so that XLA's GEMMs are cuBLAS's, as the reference's are: one of them (Muon's batched
# 3072x768 @ 768x768 product, TMA allowed) stopped two H200 runs of the record preset with
# CUDA_ERROR_ILLEGAL_INSTRUCTION at a program's first step (named by a CUDA core dump, 2026-11-27; three
# of the six record runs on GPUs so far stopped so). Without them the same run went to its end and
# compiled in 76 s instead of 166 s; its last stage's step took 888 ms instead of 832 (bench.py --profile),
# before the head gradient's transpose became a copy of its own (_train_head_vjp_bwd).
XLA_FLAG_DEFAULTS = {"xla_gpu_enable_triton_gemm": "false"}


def xla_gemms_are_cublas(environ=os.environ) -> bool:
    """Whether XLA_FLAGS turn XLA's own Triton GEMMs off (XLA_FLAG_DEFAULTS; the last value named wins), so that
    XLA's GPU GEMMs are cuBLAS's. Unset (XLA's default, on) or a file of flags: False."""
    values = re.findall(r"--xla_gpu_enable_triton_gemm(?:=(\w*))?(?=\s|$)", environ.get("XLA_FLAGS", ""))
    return bool(values) and values[-1].lower() in ("false", "0")  # a bare flag ('') turns them on


def backend_defaults(environ=os.environ) -> None:
    """Before JAX starts its backend: the GPU pool's share of memory and XLA_FLAG_DEFAULTS, where the user
    set none (XLA reads both once, when the backend starts). An XLA_FLAGS that names a file of flags (no
    leading '-', as XLA reads it) is left as it is."""
    environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)
    flags = environ.get("XLA_FLAGS", "")
    if flags.strip() and not flags.strip().startswith("-"):
        return
    named = set(re.findall(r"--(\w+)", flags))
    extra = [f"--{name}={value}" for name, value in XLA_FLAG_DEFAULTS.items() if name not in named]
    if extra:
        environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def auto_implementation(name: str) -> str:
    """--attention, --dc, --mlp or --head auto: on GPUs AUTO_ON_GPU's, the Pallas kernels where they were measured
    faster at every stage (one H200: attention, 2026-11-26, 297 / 570 / 847 ms a step against XLA's 384 / 894 /
    1,688; the MLP's, 2026-11-27, 286 / 555 / 819 ms against 295 / 567 / 845 with XLA's head), XLA elsewhere
    (Pallas interprets)."""
    return AUTO_ON_GPU[name] if jax.default_backend() == "gpu" else "xla"


def main(argv=None) -> int:
    args, overrides = parse_args(argv)
    try:
        settings = distributed_settings(args)
        if args.check:  # the backend only names the default preset: it must not take the GPUs' memory
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        else:
            backend_defaults()
            start_distributed(settings)
        preset = args.preset or ("record" if jax.default_backend() == "gpu" else "cpu")
        if not args.check:  # (the options' verdict does not depend on it)
            for name in AUTO_FIELDS:
                overrides.setdefault(name, auto_implementation(name))
        hp = with_stage_flags(dataclasses.replace(PRESETS[preset], **overrides), args)
        if args.check:
            check_outputs(hp.records_dir, args.save_weights, hp.compile_cache_dir)
            return 0
        for what, value, chosen in [("preset", preset, args.preset is None),
                                    *((name, getattr(hp, name), getattr(args, name) in (None, "auto"))
                                      for name in AUTO_FIELDS)]:
            if chosen and jax.process_index() == 0:
                console_print(f"{what} {value} (chosen because the JAX backend is {jax.default_backend()}; pass "
                              f"--{what} to choose)")
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
    faulthandler.enable()  # a crash in native code (a segmentation fault) prints every thread's Python stack
    sys.exit(main())
