"""Where the time goes: benchmarks of train_gpt.py's pieces on the current JAX backend.

  python bench.py --suite [--profile DIR] [--compile-cache-dir DIR] [--skip ...] [--out PATH]  # a table, a JSON line
  python bench.py                                       # model forward+backward of one chunk per stage shape
  python bench.py --attention xla                       # the same with the pure-JAX attention (auto: pallas on GPUs)
  python bench.py --sweep fwd:128/8/2,dq:64/8/3 [--rounds N]  # the Pallas kernels' tiles, warps, stages: a row each
  python bench.py --profile DIR                         # the profile alone (below): the quickest look

Shapes: the record preset on a GPU; elsewhere `tiny` (the cpu preset's model, head size 16, with a
8,192-token vocabulary and chunks of 512 tokens in every stage). `--preset smoke` is the smallest shape
that runs every section (vocabulary 2,048, chunks of 128 tokens: the test suite's tiny run, whose train
program it is): a check that the suite works, its numbers mean nothing.

The suite measures
  compile     seconds to compile the train programs (one per stage shape: chunk length and number
              of MTP weights) and the validation step, cold (an empty persistent cache) and warm (the
              same cache again after jax.clear_caches()), and how many programs each loaded from
              there; with --compile-cache-dir, the first from that cache as it is (where train_gpt.py
              compiled the same shapes, it loads them: minutes of a GPU's time not spent again; when
              it loads them all, that is the warm compile, and there is no second);
  train step  each stage's program as train() runs it, with that stage's windows and schedule values:
              synced every step as train() does, and pipelined (the difference is the host loop's
              cost); the preset's whole run estimated from them (steps per stage x its step time);
  model       forward+backward of one chunk (one 8-GPU rank's micro-batch) at each stage's shape;
  parts       forward+backward of each attention implementation alone at each stage's short and
              long window (the paired layers' doubled sequence apart), one FP8 MLP, the FP8 head and
              its loss; the optimizer step (NorMuon + Adam, all parameters); the validation step;
  memory      peak device memory after the train steps (device memory_stats; n/a on CPU) and XLA's
              buffer-assignment peak of the last stage's compiled program;
  profile     with --profile DIR: a jax.profiler trace of a few train steps of the last stage, the
              top 15 device ops by exclusive time (on CPU the XLA:CPU thunks; each moment the device
              runs ops goes to the innermost ones, shared where several run at once, so the ops' times
              add up to the time the device is busy) and the 20 source lines of
              train_gpt.py with the most device time (each op's under the innermost two frames of
              its HLO metadata, as tests/gpu/aot.py's static estimate ranks them; a kernel run
              inside a command buffer, by its own name: XLA names a kernel after its fusion, and one
              kernel serving identical fusions counts under the first's line; a Pallas kernel under
              its calls' lines; a cuBLAS kernel, named by cuBLAS, under its GEMM's line where its
              position between kernels of named instructions says which GEMM it is, and the header
              says how many), and the device's idle time between ops by gap length with its 5
              longest gaps and their neighbours. Without
              --suite, only this, of that program compiled alone (or, with --compile-cache-dir, loaded
              from where a train_gpt.py run of the same shapes and attention compiled it); --stage K
              profiles stage K's program instead of the last one.

FLOPs. "GFLOP" is useful work counted analytically: 2 per multiply-add of every matmul (attention
Q, K, V, O on 10 layers, the MLPs on 11, the head, the MUDD networks), x3 for forward+backward;
attention counts the (query, key) pairs its rule allows for the actual documents and window (same
document, at most W tokens back; the paired layers on their doubled sequence), 4·K FLOPs per pair
and head forward, 8·K backward, never masked work. FP8 GEMMs count as any other. MFU = those
TFLOP/s over --peak-tflops (default 989: H100 SXM dense bf16) times the devices used. "XLA GFLOP"
is XLA's cost analysis, which counts a loop body once and a custom call (a Pallas kernel) as 0:
rows whose program has a while loop are marked `loop`, and their XLA number is not the work done.
"""
import argparse
import dataclasses
import glob
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import train_gpt as tg


def small(vocab: int, chunk: int, seq: int, one_program: bool = False):
    """The cpu preset's model (head size 16) with a vocabulary of `vocab` (its last id the BOS) and
    chunks of `chunk` tokens in every stage, documents cut at `seq`; validation on one batch.
    one_program: one MTP weight in every stage, so that every stage runs the same train program."""
    cpu = tg.PRESETS["cpu"]
    mtp = dict(mtp_start=(1.0,), mtp_end=(1.0,)) if one_program else {}
    stages = tuple(dataclasses.replace(s, batch_size=8 * chunk, max_seq_len=seq, **mtp) for s in cpu.stages)
    return dataclasses.replace(cpu, vocab_size=vocab, bos_id=vocab - 1, bigram_vocab_size=1024, stages=stages,
                               val_batch_size=8 * chunk, val_tokens=8 * chunk)


PRESETS = {**tg.PRESETS, "tiny": small(8192, 512, 512), "smoke": small(2048, 128, 128, one_program=True)}
SUITE_SECTIONS = ("model", "parts")  # what --skip may leave out of the suite
PROFILE_STEPS = 3
TOP_OPS = 15
TOP_SOURCES = 20  # source lines of train_gpt.py with the most device time
TOP_GAPS = 5  # the longest idle intervals of the device, with the ops around them
GAP_SIZES = [("under 10 us", 0, 10), ("10-100 us", 10, 100), ("0.1-1 ms", 100, 1000), ("1 ms or more", 1000, math.inf)]
BOS_RATE = 1 / 1000  # documents of ~1,000 tokens, like FineWeb's


# -----------------------------------------------------------------------------
# FLOP counting (analytic)


def matmul_weights(hp) -> int:
    """Weights used in a matmul once per token: attention Q, K, V, O (10 layers), MLP (11), head, the
    MUDD and MUDD-gate networks (each of their two blocks runs once). Embeddings are lookups."""
    D, G = hp.model_dim, tg.MUDD_DIM
    mudd = 4 * G * D + (tg.MUDD_LAYER10 + tg.MUDD_FINAL + tg.PRE_GATE + tg.POST_GATE) * G  # first layers, outputs
    return len(tg.ATTN_LAYERS) * 4 * D * D + tg.NUM_LAYERS * 8 * D * D + hp.padded_vocab * D + mudd


def attention_pairs(docs_T, window: int) -> int:
    """(query, key) pairs the rule allows: key at most `window` tokens back, same document."""
    docs_T = np.asarray(docs_T)
    q = np.arange(len(docs_T))
    new_doc = np.r_[True, docs_T[1:] != docs_T[:-1]]
    doc_start = np.maximum.accumulate(np.where(new_doc, q, 0))
    return int(np.sum(np.minimum(q - doc_start, window) + 1))


def layer_pairs(docs_T, short: int, long: int) -> int:
    """Pairs x heads over the attention layers: paired layers attend over the doubled sequence with
    half the heads, the long-window layers at `long`, the others at `short`."""
    total = 0
    for layer in tg.ATTN_LAYERS:
        window = long if layer in tg.LONG_WINDOW_LAYERS else short
        if layer in tg.PAIRED_LAYERS:
            total += tg.NUM_HEADS // 2 * attention_pairs(np.repeat(docs_T, 2), window)
        else:
            total += tg.NUM_HEADS * attention_pairs(docs_T, window)
    return total


def dc_flops(docs_T, K: int) -> int:
    """Useful FLOPs of layer 10's DC correction, forward and backward: each head's visible pairs (keys at most
    DC_WINDOW - 1 tokens back, same document) at 12·K, counted as attention's."""
    return 12 * K * tg.NUM_HEADS * attention_pairs(docs_T, tg.DC_WINDOW - 1)


def model_flops(hp, docs_RxT, short: int, long: int, backward: bool = True) -> float:
    """Useful FLOPs of the model on these chunks: matmuls plus the allowed attention pairs."""
    K = hp.head_dim
    pairs = sum(layer_pairs(docs, short, long) for docs in docs_RxT)
    return (6 if backward else 2) * matmul_weights(hp) * np.size(docs_RxT) + (12 if backward else 4) * K * pairs


def polar_express_flops(hp) -> int:
    """The NorMuon banks' Polar Express: per iteration X·Xᵀ (2m²n), A·A (2m³) and B·X (2m²n) per matrix,
    made wide (m <= n)."""
    D, K = hp.model_dim, hp.head_dim
    matrices = ([(2 * K, D)] * tg.num_qk_matrices() + [(D, D)] * 2 * len(tg.ATTN_LAYERS)
                + [(4 * D, D)] * 2 * tg.NUM_LAYERS)
    iterations = len(tg.POLAR_EXPRESS_COEFFS)
    return sum(iterations * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3) for a, b in matrices)


# -----------------------------------------------------------------------------
# Timing


def compile_timed(jitted, *args):
    """Trace, lower and compile (as train() does before its clock starts); returns (compiled, seconds)."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def seconds_per_call(fn, args, repeats: int, warm_up: bool = True) -> float:
    """Median seconds of `repeats` calls, after one untimed call (first-call costs) unless warm_up is False."""
    if warm_up:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def xla_cost(compiled):
    """XLA's FLOP count of a compiled program and whether it loops (then that count misses the trip counts)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    return (cost or {}).get("flops"), bool(re.search(r"\bwhile\(", compiled.as_text()))


class Table:
    """Rows of measurements, by name: the printed table and the JSON share them."""

    COLUMNS = (("ms", 9, "ms", "{:.2f}"), ("tokens/s", 11, "tokens_per_s", "{:,.0f}"), ("GFLOP", 9, "gflop", "{:.1f}"),
               ("TFLOP/s", 8, "tflops", "{:.2f}"), ("MFU", 7, "mfu", "{:.1%}"), ("MFU nom.", 8, "mfu_nominal", "{:.1%}"),
               ("XLA GFLOP", 14, "xla_gflop", "{:.1f}"), ("compile s", 9, "compile_s", "{:.1f}"))

    def __init__(self, peak_tflops: float):
        self.peak = peak_tflops
        self.rows = {}
        self._last = (None, (None, False))  # (compiled, xla_cost): rows of one program come together

    def add(self, name, sec, *, tokens=None, flops=None, nominal=None, devices=1, compiled=None, compile_s=None,
            note=""):
        if compiled is not None and compiled is not self._last[0]:
            self._last = (compiled, xla_cost(compiled))  # once per program: a train step's HLO text is large
        xla_flops, loops = self._last[1] if compiled is not None else (None, False)
        self.rows[name] = {
            "ms": sec * 1e3,
            "tokens_per_s": tokens / sec if tokens else None,
            "gflop": None if flops is None else flops / 1e9,
            "tflops": None if flops is None else flops / sec / 1e12,
            "mfu": None if flops is None else flops / sec / 1e12 / (self.peak * devices),
            "mfu_nominal": None if nominal is None else nominal / sec / 1e12 / (self.peak * devices),
            "xla_gflop": None if xla_flops is None else xla_flops / 1e9,
            "xla_loop": loops,
            "compile_s": compile_s,
            "note": note,
        }
        print(f"bench: {name}: {sec * 1e3:.2f} ms", file=sys.stderr, flush=True)  # progress, kept if a later part dies

    def lines(self) -> list:
        out = [f"{'part':<42}" + "".join(f"{title:>{width + 2}}" for title, width, _, _ in self.COLUMNS) + "  note"]
        for name, row in self.rows.items():
            cells = []
            for _, width, key, fmt in self.COLUMNS:
                text = "-" if row[key] is None else fmt.format(row[key])
                if key == "xla_gflop" and row[key] is not None and row["xla_loop"]:
                    text += " loop"
                cells.append(f"{text:>{width + 2}}")
            out.append(f"{name:<42}" + "".join(cells) + (f"  {row['note']}" if row["note"] else ""))
        return out


# -----------------------------------------------------------------------------
# Inputs


def sample_chunks(rng, hp, R: int, T: int):
    """(inputs, targets) int32 (R, T): random token ids, each chunk opened by a BOS and with more BOS
    at rate 1/1000, documents cut as the loader cuts them only in length (the model does not care)."""
    tokens = rng.integers(0, hp.vocab_size, (R, T + 1))
    tokens[rng.random(tokens.shape) < BOS_RATE] = hp.bos_id
    tokens[:, 0] = hp.bos_id
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:].astype(np.int32)


def documents(inputs, bos: int):
    """Document number of each token, as the model computes them (a BOS opens a document)."""
    return np.cumsum(inputs == bos, axis=-1)


def random_like(rng, tree):
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), tree)


def fwd_bwd(f, n_diff: int):
    """Jitted forward + backward of f with respect to its first n_diff arguments; the cotangent comes last."""

    def run(*args):
        *args, cotangent = args
        _, vjp = jax.vjp(lambda *diff: f(*diff, *args[n_diff:]), *args[:n_diff])
        return vjp(cotangent)

    return jax.jit(run, compiler_options=tg.COMPILER_OPTIONS)  # rounding as the train program does


# -----------------------------------------------------------------------------
# The suite's parts


def time_part(table, name, f, args, n_diff, rng, repeats, *, windows=None, flops=None, tokens=None, note=""):
    """Compile f's forward+backward once and time it (at each window, passed as f's last argument)."""
    example = (*args, jnp.int32(windows[0])) if windows else args
    cotangent = random_like(rng, jax.eval_shape(f, *example))
    compiled, compile_s = compile_timed(fwd_bwd(f, n_diff), *example, cotangent)
    for i, window in enumerate(windows or [None]):
        call_args = (*args, jnp.int32(window), cotangent) if windows else (*args, cotangent)
        sec = seconds_per_call(compiled, call_args, repeats, warm_up=i == 0)
        table.add(f"{name} W={window}" if windows else name, sec, tokens=tokens,
                  flops=flops(window) if callable(flops) else flops, compiled=compiled, compile_s=compile_s,
                  note=note(window) if callable(note) else note)


def attention_kernel_rows(table, hp, impl, docs_T, windows, rng, repeats):
    """One attention implementation alone at each window of the stages: 6 heads on the chunk, and the
    paired layers' 3 heads on the doubled sequence at the short windows. Pallas: one compile, the
    window a runtime value; XLA: a compile per window, its loop as long as the window needs (a train
    program's static count). Then layer 10's DC correction, added to its attention output."""
    T, H, K = len(docs_T), tg.NUM_HEADS, hp.head_dim
    attend = tg.ATTENTION[impl]
    scale = jnp.float32(0.1)
    for heads, length, paired in ((H, T, False), (H // 2, 2 * T, True)):
        q, k, v = (jnp.asarray(rng.standard_normal((length, heads, K)), jnp.bfloat16) for _ in range(3))
        docs = np.repeat(docs_T, 2) if paired else np.asarray(docs_T)
        ws = sorted({w for pair in windows for w in (pair[:1] if paired else pair)})
        for group in ([[w] for w in ws] if impl == "xla" else [ws]):
            bound = (int(tg._num_diagonals(group[0], length // tg.BLOCK)),) if impl == "xla" else ()
            time_part(table, f"attention {impl}{' paired' if paired else ''}",
                      lambda q, k, v, d, w, bound=bound: attend(q, k, v, d, w, scale, *bound),
                      (q, k, v, jnp.asarray(docs, jnp.int32)), 3, rng, repeats, windows=group, tokens=T,
                      flops=lambda w, docs=docs, heads=heads: 12 * K * heads * attention_pairs(docs, w),
                      note=lambda w, docs=docs: f"{attention_pairs(docs, w) / len(docs):.0f} keys/query")
    # layer 10's DC correction (its own kernels with --dc pallas): its window is fixed, its inputs those
    # of the attention plus the attention's output and the two head-mixing weights
    y, q, k, v = (jnp.asarray(rng.standard_normal((T, H, K)), jnp.bfloat16) for _ in range(4))
    w1, w2 = (jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16) for _ in range(2))
    docs = jnp.asarray(docs_T, jnp.int32)
    time_part(table, f"DC correction {impl}", lambda *x: tg.ADD_DC_CORRECTION[impl](*x[:4], docs, *x[4:], scale),
              (y, q, k, v, w1, w2), 6, rng, repeats, tokens=T, flops=dc_flops(docs_T, K),
              note=f"{attention_pairs(docs_T, tg.DC_WINDOW - 1) / T:.0f} keys/query")


def block_part_rows(table, hp, params, inputs_T, targets_T, rng, repeats):
    """One FP8 MLP (layer 0's weights, activation scale 1) per --mlp implementation, and the FP8 head + loss
    per --head implementation."""
    T, D = len(inputs_T), hp.model_dim
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    w1, w2 = params["mlp_bank"][0, 0], params["mlp_bank"][0, 1]
    w_scale = tg.measured_scale(w2) * np.float32(tg.MLP_WEIGHT_HEADROOM)
    valid = jnp.ones(T, bool)
    for impl in tg.GEMM_IMPLEMENTATIONS:
        time_part(table, f"MLP fp8 (one layer) {impl}",
                  lambda x, w1, w2, impl=impl: tg.mlp_fp8(x, w1, w2, w_scale, jnp.float32(1.0), valid, impl)[0],
                  (x, w1, w2), 3, rng, repeats, tokens=T, flops=6 * 8 * D * D * T)
    mtp, pw = tg.loss_weights(0, hp)
    prefix = tg.prefix_targets(jnp.asarray(tg.prefix_table(hp.padded_vocab)), jnp.asarray(targets_T))
    cols, ws, total = tg._loss_targets(jnp.asarray(targets_T), jnp.asarray(mtp), prefix, pw, hp.padded_vocab)
    for impl in tg.GEMM_IMPLEMENTATIONS:
        time_part(table, f"head + loss fp8 (MTP, prefix) {impl}",
                  lambda h, w, impl=impl: tg.train_head_loss(h, w, cols, ws, total, impl)[0],
                  (x, params["lm_head.weight"]), 2, rng, repeats, tokens=T, flops=6 * hp.padded_vocab * D * T,
                  note="gradient built in the forward")


def optimizer_rows(table, hp, mesh, params, rng, repeats):
    """One optimizer step from random gradients: NorMuon on the banks, Adam on the rest (an odd step)."""
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    grads = jax.device_put(random_like(rng, params), replicated)
    state = jax.jit(lambda p: tg.init_optimizer_state(p, hp), out_shardings=replicated)(params)
    sv = tg.step_values_at(1, hp)
    step = jax.jit(lambda p, g, s, sv: tg.optimizer_step(p, g, s, hp, sv), compiler_options=tg.COMPILER_OPTIONS)
    compiled, compile_s = compile_timed(step, params, grads, state, sv)
    sec = seconds_per_call(compiled, (params, grads, state, sv), repeats)
    table.add("optimizer step (NorMuon + Adam)", sec, flops=polar_express_flops(hp), compiled=compiled,
              compile_s=compile_s, devices=mesh.size,
              note="FLOPs: Polar Express only (the rest is elementwise); whole on each device (the train step "
                   "splits it among several)")


def kernels_named(hp) -> str:
    """" dc pallas mlp pallas head pallas", some of it, or "": which of hp's DC correction and FP8 parts run
    Pallas kernels, for a row's name (the attention's implementation is named on its own)."""
    return "".join(f" {part} pallas" for part in ("dc", "mlp", "head") if getattr(hp, part) == "pallas")


def model_rows(table, hp, params, inputs_RxT, targets_RxT, repeats):
    """The model's loss and gradients for one chunk at each stage shape (training, FP8), its windows
    and schedule values, with hp's attention, DC, MLP and head implementations; one compile per shape."""
    attention = hp.attention
    trainable = tg.trainable(params, hp)
    buffers = {k: v for k, v in params.items() if k not in trainable}
    prefix_V = jnp.asarray(tg.prefix_table(hp.padded_vocab))
    for first in tg.program_steps(hp):
        T = tg.stage_shape(first, hp)[0]
        inputs, targets = jnp.asarray(inputs_RxT[0, :T]), jnp.asarray(targets_RxT[0, :T])
        a = tg.schedule_values(first, hp)
        scales = tg.fp8_mlp_scales(params, first, hp)
        short, long = (int(w) for w in tg.windows(first, hp))

        bounds = tg.max_diagonals(hp, tg.stage_shape(first, hp)) if attention == "xla" else None

        def loss_and_grads(p, inputs, targets, a, bounds=bounds):  # the XLA loops' counts static, as in training
            a = tg.with_max_diagonals(a, bounds)
            return jax.value_and_grad(lambda p: tg.sequence_loss(
                {**buffers, **p}, inputs, targets, a, True, scales, tg.prefix_targets(prefix_V, targets),
                attention, hp.mlp, hp.head, dc_impl=hp.dc)[0])(p)

        compiled, compile_s = compile_timed(jax.jit(loss_and_grads, compiler_options=tg.COMPILER_OPTIONS), trainable,
                                            inputs, targets, a)
        sec = seconds_per_call(compiled, (trainable, inputs, targets, a), repeats)
        docs = documents(inputs_RxT[:1, :T], hp.bos_id)
        name = f"model fwd+bwd {attention}{kernels_named(hp)} stage {tg.stage_of(first, hp)[0]} T={T}"
        table.add(f"{name} W={short}/{long}", sec, tokens=T, flops=model_flops(hp, docs, short, long),
                  compiled=compiled, compile_s=compile_s)


# -----------------------------------------------------------------------------
# The train and validation steps as train() builds them


def compile_twice(hp, mesh, state, prefix_V):
    """compile_steps with the persistent cache as it is (empty: cold), forget the programs in memory,
    compile again (warm); each time the programs loaded from the cache are counted (the second time all
    of them, unless JAX could not store or load one: then it compiled that one again). When the first
    loaded them all (a given cache), it was the warm compile: no second (again_s, again_loaded None)."""
    t0 = time.perf_counter()
    programs, val_step, loaded = tg.compile_steps(hp, mesh, *state, prefix_V)
    result = {"first_s": time.perf_counter() - t0, "first_loaded": loaded, "again_s": None, "again_loaded": None,
              "programs": len(programs) + 1}
    if loaded < result["programs"]:
        jax.clear_caches()
        t0 = time.perf_counter()
        programs, val_step, loaded = tg.compile_steps(hp, mesh, *state, prefix_V)
        result |= {"again_s": time.perf_counter() - t0, "again_loaded": loaded}
    return programs, val_step, result


def run_train_steps(program, state, x, y, inputs, prefix_V, n, synced=True):
    """n steps of one stage's program chained as train() chains them (params, optimizer and FP8 state
    are donated); returns (state, seconds per step)."""
    params, buffers, opt_state, fp8 = state
    t0 = time.perf_counter()
    for _ in range(n):
        params, opt_state, fp8, loss = program(params, buffers, opt_state, fp8, x, y, *inputs, prefix_V)
        if synced:
            float(loss)  # train() reads every step's loss
    float(loss)
    return (params, buffers, opt_state, fp8), (time.perf_counter() - t0) / n


def memory_report(compiled_train) -> dict:
    """Peak device memory so far (read right after the train steps, before anything else runs) and XLA's own
    peak for the compiled step."""
    stats = jax.local_devices()[0].memory_stats() or {}
    analysis = compiled_train.memory_analysis()
    xla_peak = getattr(analysis, "peak_memory_in_bytes", 0) or (
        analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes)
    peak = stats.get("peak_bytes_in_use")
    return {
        "peak_mib": None if peak is None else peak / 2**20,
        "peak_source": "device memory_stats peak_bytes_in_use (process so far: compile + train steps)"
        if peak is not None else f"n/a: the {jax.default_backend()} backend reports no device memory stats",
        "compiled_peak_mib": xla_peak / 2**20,
        "compiled_source": "XLA buffer assignment of the last stage's compiled train program (memory_analysis)",
    }


def estimated_run_s(hp, ms_by_first: dict) -> float:
    """The preset's training time: each step at its stage program's measured time."""
    firsts = sorted(ms_by_first)
    shape_ms = {tg.stage_shape(f, hp): ms_by_first[f] for f in firsts}
    return sum(shape_ms[tg.stage_shape(s, hp)] for s in range(hp.total_steps)) / 1e3


def stage_batch(rng, hp, mesh, first: int):
    """A step's random chunks at the shape of the stage starting at `first` (host inputs, then inputs
    and targets on the devices) and the schedule values of an odd step there: NorMuon and Adam."""
    inputs, targets = sample_chunks(rng, hp, tg.RANKS, tg.stage_shape(first, hp)[0])
    x, y = (jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in (inputs, targets))
    return inputs, x, y, tg.step_inputs(first | 1, hp)


def train_rows(table, hp, mesh, rng, repeats):
    """Compile the train programs and the validation step twice (compile_twice), time each stage's program
    (synced, then pipelined for the last), read the peak memory, time the validation step."""
    print("bench: compiling the train and validation steps, twice", file=sys.stderr, flush=True)
    replicated, by_chunk = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    state = tg.initial_state(hp, mesh)
    prefix_V = jax.device_put(tg.prefix_table(hp.padded_vocab), replicated)
    programs, val_step, compile_s = compile_twice(hp, mesh, state, prefix_V)
    ms, last = {}, None
    for first in tg.program_steps(hp):
        shape = tg.stage_shape(first, hp)
        inputs, x, y, step_inputs = stage_batch(rng, hp, mesh, first)
        state, _ = run_train_steps(programs[shape], state, x, y, step_inputs, prefix_V, 1)  # warm-up
        state, sec = run_train_steps(programs[shape], state, x, y, step_inputs, prefix_V, repeats)
        short, long = (int(w) for w in tg.windows(first, hp))
        stage = tg.stage_of(first, hp)[0]
        batch = tg.RANKS * shape[0]
        table.add(f"train step stage {stage} (synced) W={short}/{long}", sec, tokens=batch, devices=mesh.size,
                  flops=model_flops(hp, documents(inputs, hp.bos_id), short, long), compiled=programs[shape])
        ms[first], last = sec * 1e3, (programs[shape], x, y, step_inputs, inputs, short, long, stage, batch)
    program, x, y, step_inputs, inputs, short, long, stage, batch = last
    state, pipelined = run_train_steps(program, state, x, y, step_inputs, prefix_V, repeats, synced=False)
    table.add(f"train step stage {stage} (pipelined) W={short}/{long}", pipelined, tokens=batch, devices=mesh.size,
              flops=model_flops(hp, documents(inputs, hp.bos_id), short, long),
              note="no per-step sync: the device-bound step time")
    memory = memory_report(program)
    a = {k: v for k, v in tg.schedule_values(hp.total_steps, hp, final_val=True).items() if k in tg.VAL_KEYS}
    val_inputs, val_targets = sample_chunks(rng, hp, tg.RANKS, hp.val_batch_size // tg.RANKS)
    vx, vy = (jax.device_put(v, by_chunk) for v in (val_inputs, val_targets))
    val_sec = seconds_per_call(val_step, (state[0], state[1], vx, vy, a), repeats)
    table.add("validation step (final windows)", val_sec, tokens=hp.val_batch_size, devices=mesh.size,
              flops=model_flops(hp, documents(val_inputs, hp.bos_id), *(int(w) for w in tg.windows(
                  hp.total_steps, hp, True)), backward=False), compiled=val_step, note="forward, bf16 head")
    summary = {"ms_by_stage": {str(tg.stage_of(f, hp)[0]): v for f, v in ms.items()},
               "ms_pipelined_last_stage": pipelined * 1e3, "host_loop_ms": ms[max(ms)] - pipelined * 1e3,
               "tokens_per_s_last_stage": batch / (ms[max(ms)] / 1e3),
               "estimated_run_s": estimated_run_s(hp, ms),
               "estimated_run_note": f"{hp.total_steps} steps, each at its stage program's synced step time; "
                                     f"validation excluded, as on the record clock"}
    return compile_s, summary, memory, (program, state, x, y, step_inputs, prefix_V)


# -----------------------------------------------------------------------------
# Profile: top device ops from the trace jax.profiler writes (DIR/plugins/profile/<run>/<host>.trace.json.gz)

DERIVED_LINES = {"XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code", "TensorFlow Ops",
                 "TensorFlow Name Scope", "Launch Stats"}
HLO_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*?op_name="([^"]+)"', re.M)
HLO_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = ', re.M)
HLO_OP_FRAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*?(stack_frame_id=\d+)', re.M)
# a Triton custom call (train_gpt's Pallas kernels on a GPU) and its kernel's name: the last `name = "..."` of
# the line, in the backend config after the kernel's IR
TRITON_CALL = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?custom_call_target="__gpu\$xla\.gpu\.triton"'
                         r'.*\bname = "([^"]+)"', re.M)
HLO_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{$")  # a computation's first line
CUBLAS_CALL = re.compile(r'custom_call_target="__cublas')  # XLA's GEMMs (cuBLAS, cuBLASLt, FP8 or not)
LIBRARY_GEMM_KERNEL = re.compile(r"nvjet|gemm|xmma|cutlass", re.I)  # a cuBLAS kernel's name (nvjet_sm90_...)


def profile_rows(train_state, trace_dir):
    """A trace of PROFILE_STEPS train steps of the last stage's program, and its top device ops."""
    program, state, x, y, step_inputs, prefix_V = train_state
    os.makedirs(trace_dir, exist_ok=True)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    if jax.default_backend() == "cpu":
        options.host_tracer_level = 3  # XLA:CPU records its thunks (the ops) only at the verbose level
    with jax.profiler.trace(trace_dir, profiler_options=options):
        _, sec = run_train_steps(program, state, x, y, step_inputs, prefix_V, PROFILE_STEPS)
    return top_device_ops(latest_trace(trace_dir), PROFILE_STEPS, sec * 1e3, program.as_text())


def latest_trace(trace_dir: str) -> str:
    files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"jax.profiler wrote no *.trace.json.gz under {trace_dir}/plugins/profile")
    return max(files, key=os.path.getmtime)


def device_op_events(events: list) -> list:
    """Complete events of device ops: on GPU/TPU those of the '/device:*' processes (their 'XLA Ops' line
    if there is one, else every line but the derived summaries); on CPU the host events carrying an
    hlo_op, which are XLA:CPU's thunks."""
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    lines = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    if not devices:
        return [e for e in complete if "hlo_op" in e.get("args", {})]
    on_device = [e for e in complete if e["pid"] in devices]
    xla_ops = {key for key, name in lines.items() if key[0] in devices and name == "XLA Ops"}
    if xla_ops:
        return [e for e in on_device if (e["pid"], e["tid"]) in xla_ops]
    return [e for e in on_device if lines.get((e["pid"], e["tid"])) not in DERIVED_LINES]


def exclusive_times(events: list) -> list:
    """(event, its exclusive time): each moment the device runs an op goes to the innermost ops
    running then (those enclosing no other running op: a while loop's own time excludes its body's
    ops), shared equally where several run at once (concurrent kernels, whose spans may overlap in
    part). So the times add up to the time at least one op runs, with nothing counted twice or lost."""
    def key(i):
        return events[i]["ts"], -events[i]["dur"], i
    starts = sorted(range(len(events)), key=key)
    bounds = sorted({t for e in events for t in (e["ts"], e["ts"] + e["dur"])})
    own, active, nxt = [0.0] * len(events), [], 0  # active: (start, end, index) in key order
    for t0, t1 in zip(bounds, bounds[1:]):
        active = [a for a in active if a[1] > t0]
        while nxt < len(starts) and events[starts[nxt]]["ts"] <= t0:
            i = starts[nxt]
            if events[i]["dur"] > 0:  # starts come in key order: appending keeps active sorted
                active.append((events[i]["ts"], events[i]["ts"] + events[i]["dur"], i))
            nxt += 1
        # a running op encloses another iff one after it in key order (a later start, or the same start and
        # a span no longer; identical spans: the one listed later) ends no later than it
        leaves, first_end = [], math.inf
        for _, end, i in reversed(active):
            if end < first_end:
                leaves.append(i)
            first_end = min(first_end, end)
        for i in leaves:
            own[i] += (t1 - t0) / len(leaves)
    return list(zip(events, own))


def source_of(text: str):
    """A compiled HLO module's text -> where(attrs): 'function:line < caller:line', the innermost two
    frames of the instruction with those attributes (its metadata's stack_frame_id), or '?'."""
    def table(name):
        block = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
        return {int(line.split()[0]): line for line in block[1].splitlines()} if block else {}

    functions = {i: line.split(None, 1)[1].strip('"') for i, line in table("FunctionNames").items()}
    fields = lambda line: dict(re.findall(r"(\w+)=(\d+)", line))  # noqa: E731
    locations = {i: fields(line) for i, line in table("FileLocations").items()}
    frames = {i: fields(line) for i, line in table("StackFrames").items()}

    def where(attrs):
        frame = re.search(r"stack_frame_id=(\d+)", attrs)
        chain, f = [], int(frame[1]) if frame else None
        while f in frames and len(chain) < 2:
            loc = locations[int(frames[f]["file_location_id"])]
            chain.append(f"{functions[int(loc['function_name_id'])]}:{loc['line']}")
            f = int(frames[f]["parent_frame_id"]) - 1  # the text's parent ids are one past the frame's (0: none)
        return " < ".join(chain) or "?"
    return where


def top_device_ops(trace_path: str, steps: int, step_ms: float, hlo_text: str = "", k: int = TOP_OPS) -> dict:
    """The k device ops with the most exclusive time (exclusive_times): count and ms per step of one device
    (the mean over the trace's devices; on CPU every device's thunks run in the host's one process, which
    counts as one), % of the profiled step time."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    jax_names = dict(HLO_OP_NAME.findall(hlo_text))
    where = source_of(hlo_text)
    sources = {op: where(frame) for op, frame in HLO_OP_FRAME.findall(hlo_text)}
    # Inside a command buffer the event's hlo_op is the buffer's, so the kernel's name says what ran: XLA
    # names a fusion's kernel after it ('.' and '-' made '_'), a Triton custom call's (a Pallas kernel's)
    # after the call's name, and appends '__N' to a second kernel of a name. Calls of one Pallas kernel
    # whose kernels differ (other shapes) cannot be told apart by name: such a kernel is a row of its own,
    # under the source lines of all the calls of its name.
    by_kernel = {re.sub(r"[.-]", "_", name): name for name in HLO_INSTRUCTION.findall(hlo_text)}
    calls_of = defaultdict(list)
    for call, kernel_name in TRITON_CALL.findall(hlo_text):
        calls_of[kernel_name].append(call)
    def named_op(e):
        op = e.get("args", {}).get("hlo_op")
        if op and not re.fullmatch(r"command_buffer[._]\d+", op):
            return op  # the event names its instruction
        # a kernel inside a command buffer, or an event naming no instruction: its kernel's name says what ran
        base = re.sub(r"__\d+$", "", e["name"])
        if base in calls_of:
            sources.setdefault(e["name"], " | ".join(sorted({sources.get(c, "?") for c in calls_of[base]})))
            jax_names.setdefault(e["name"], jax_names.get(calls_of[base][0]))
            return e["name"]
        return by_kernel.get(e["name"]) or by_kernel.get(base)  # None: a kernel of no instruction

    device_events = device_op_events(events)
    instruction = {id(e): named_op(e) for e in device_events}
    placed = gemms_by_position(device_events, instruction, hlo_text)

    def op_of(e):  # a kernel of no instruction, not placed (a copy, ...): by its own name, not lumped with others
        return instruction[id(e)] or placed.get(id(e)) or e["name"]

    by_device = defaultdict(list)
    for e in device_events:
        by_device[e["pid"]].append(e)
    per = steps * max(len(by_device), 1)  # figures per step of one device (the mean over the devices)
    total_us, count, kernel, gaps, span_us = defaultdict(float), defaultdict(int), {}, [], 0.0
    for dev in by_device.values():
        for e, own_us in exclusive_times(dev):
            op = op_of(e)
            total_us[op] += own_us
            count[op] += 1
            kernel.setdefault(op, e["name"])
        gaps += idle_gaps(dev)
        span_us += max(e["ts"] + e["dur"] for e in dev) - min(e["ts"] for e in dev)
    ops = [{"op": op, "kernel": kernel[op] if kernel[op] != op else None, "jax_op": jax_names.get(op),
            "count": count[op] / per, "ms": total_us[op] / 1e3 / per,
            "pct_of_step": 100 * total_us[op] / 1e3 / per / step_ms}
           for op in sorted(total_us, key=total_us.get, reverse=True)[:k]]
    by_source, source_count = defaultdict(float), defaultdict(int)  # every op's time under its source line
    for op, us in total_us.items():
        source = sources.get(op, "?")
        by_source[source] += us
        source_count[source] += count[op]
    lines = [{"source": s, "count": source_count[s] / per, "ms": by_source[s] / 1e3 / per,
              "pct_of_step": 100 * by_source[s] / 1e3 / per / step_ms}
             for s in sorted(by_source, key=by_source.get, reverse=True)[:TOP_SOURCES]]
    busy_ms = sum(total_us.values()) / 1e3 / per
    def named(e):  # "op (source line)"
        return f"{op_of(e)} ({sources.get(op_of(e), '?')})"

    gaps = [{**gap, "after": named(gap["after"]), "before": named(gap["before"])} for gap in gaps]
    idle_ms = sum(g["us"] for g in gaps) / 1e3 / per
    idle = {"ops_per_step": sum(count.values()) / per, "ms_per_step": idle_ms,
            "by_size": [{"gaps": name, "count": sum(lo <= g["us"] < hi for g in gaps) / per,
                         "ms": sum(g["us"] for g in gaps if lo <= g["us"] < hi) / 1e3 / per}
                        for name, lo, hi in GAP_SIZES],
            "longest": sorted(gaps, key=lambda g: -g["us"])[:TOP_GAPS],
            # the step's time outside the device's first op .. last op: the host's first launch and last read-back
            "outside_ms_per_step": step_ms - span_us / 1e3 / per}
    gemm_kernels = [e for e in device_events if instruction[id(e)] is None and LIBRARY_GEMM_KERNEL.search(e["name"])]
    gemms = {"kernels": len(gemm_kernels) / per, "placed": sum(id(e) in placed for e in gemm_kernels) / per,
             "ms": sum(e["dur"] for e in gemm_kernels) / 1e3 / per,
             "placed_ms": sum(e["dur"] for e in gemm_kernels if id(e) in placed) / 1e3 / per}
    return {"trace": trace_path, "steps": steps, "step_ms": step_ms, "device_busy_ms": busy_ms,
            "device_busy_pct": 100 * busy_ms / step_ms, "top_ops": ops, "top_sources": lines, "idle": idle,
            "library_gemms": gemms}


def schedule(hlo_text: str) -> tuple:
    """A scheduled module's text (each computation's instructions in the order they run) -> ({instruction:
    (computation, index)}, {computation: [(index, cuBLAS call)]}). A fusion around a cuBLAS call (XLA's
    dynamic-slice fusion: the GEMM reads a slice in place) is that call at the fusion's place: the
    text lists a fused computation before its callers."""
    at, calls, computation = {}, defaultdict(list), None
    for line in hlo_text.splitlines():
        if head := HLO_COMPUTATION.match(line):
            computation = head[1]
        elif computation and (ins := HLO_INSTRUCTION.match(line)):
            at[ins[1]] = (computation, len(at))
            fused = re.search(r"\bcalls=%?([\w.\-]+)", line)
            if CUBLAS_CALL.search(line):
                calls[computation].append((len(at) - 1, ins[1]))
            elif fused and calls.get(fused[1]):
                calls[computation].append((len(at) - 1, calls[fused[1]][0][1]))
    return at, calls


def gemms_by_position(events: list, instruction: dict, hlo_text: str) -> dict:
    """{id(event): the cuBLAS call it ran} for the GEMM kernels that name no instruction (cuBLAS's inside a
    command buffer, whose events carry the buffer's name and a kernel name of cuBLAS's own). One stream runs
    its kernels in the order launched: the kernels between two of named instructions A and B of one
    computation ran its instructions between A and B, so GEMM kernels there are its cuBLAS calls there,
    in order, where their numbers agree; elsewhere (another number, A and B in other computations, no A)
    they stay unplaced, rows of their own by their names. Kernels of two streams on one trace line (its
    "XLA Ops" line holds all) could be placed wrongly where the numbers agree by chance; most disagree.
    A kernel serving identical fusions (XLA names it after the first) anchors at the first's place: GEMM
    kernels next to a later copy mostly stay unplaced. instruction: {id(event): its instruction, or None}."""
    at, calls = schedule(hlo_text)
    placed, streams = {}, defaultdict(list)
    for e in events:
        streams[e["pid"], e["tid"]].append(e)
    for stream in streams.values():
        anchor, pending = None, []
        for e in sorted(stream, key=lambda e: e["ts"]):
            op = instruction[id(e)]
            if op in at:
                if anchor is not None and pending:
                    (comp_a, a), (comp_b, b) = at[anchor], at[op]
                    between = [call for i, call in calls[comp_a] if a < i < b] if comp_a == comp_b else []
                    if len(between) == len(pending):
                        placed.update(zip(map(id, pending), between))
                anchor, pending = op, []
            elif op is None and LIBRARY_GEMM_KERNEL.search(e["name"]):
                pending.append(e)
    return placed


def idle_gaps(events: list) -> list:
    """The device's idle intervals between its first op and its last, where no op of any line runs:
    {us, after: the op that ended last before it, before: the op that starts it}. Many short gaps
    mean the host launches kernels slower than the device runs them; a few long ones, a wait (a
    transfer, the host reading a value back)."""
    gaps, end, last = [], None, None
    for e in sorted(events, key=lambda e: e["ts"]):
        if end is not None and e["ts"] > end:
            gaps.append({"us": e["ts"] - end, "after": last, "before": e})
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    return gaps


def short_op_name(op_name: str, width: int = 70) -> str:
    """The end of a JAX op path that fits in width, without the outer jit(...) scope."""
    parts = [p for p in op_name.split("/") if not p.startswith("jit(")]
    kept = []
    while parts and len("/".join([parts[-1], *kept])) <= width:
        kept.insert(0, parts.pop())
    return ("…/" if parts else "") + "/".join(kept)


def profile_lines(profile: dict) -> list:
    idle = profile["idle"]
    out = [f"profile: {profile['steps']} train steps, {profile['step_ms']:.1f} ms/step under the profiler; the device "
           f"busy {profile['device_busy_ms']:.1f} ms/step ({profile['device_busy_pct']:.0f}% of the step: the time "
           f"some op runs), idle between ops {idle['ms_per_step']:.1f}, outside its first op .. last "
           f"{idle['outside_ms_per_step']:.1f}; trace {profile['trace']}",
           f"{'op':<36}{'count':>8}{'ms':>10}{'% step':>8}  jax op (or kernel)"]
    gemms = profile.get("library_gemms", {})
    if gemms.get("kernels"):  # cuBLAS's kernels in command buffers: their calls read from the schedule, or not
        out.insert(1, f"profile: cuBLAS kernels naming no instruction (inside command buffers) {gemms['kernels']:.4g} a "
                      f"step, {gemms['ms']:.1f} ms; placed at their cuBLAS calls by their position between named "
                      f"kernels (gemms_by_position) {gemms['placed']:.4g}, {gemms['placed_ms']:.1f} ms; the rest are "
                      f"rows by their kernel names, under '?'")
    for op in profile["top_ops"]:
        where = short_op_name(op["jax_op"]) if op["jax_op"] else (op["kernel"] or "")[:70]
        out.append(f"{op['op'][:36]:<36}{op['count']:>8.4g}{op['ms']:>10.2f}{op['pct_of_step']:>8.1f}  {where}")
    out += ["", "every device op's exclusive time by its source line (tests/gpu/aot.py's estimate ranks the same "
            "lines)",
            f"{'ms':>10}{'% step':>8}{'ops':>8}  source (function:line < caller:line)"]
    for line in profile["top_sources"]:
        out.append(f"{line['ms']:>10.2f}{line['pct_of_step']:>8.1f}{line['count']:>8.4g}  {line['source']}")
    sizes = ", ".join(f"{b['gaps']} {b['count']:.4g} ({b['ms']:.1f} ms)" for b in idle["by_size"])
    out += ["", f"the device idle between ops: {idle['ms_per_step']:.1f} ms/step over {idle['ops_per_step']:.0f} "
            f"ops/step; gaps a step by length: {sizes}"]
    for gap in idle["longest"]:
        out.append(f"  idle {gap['us'] / 1e3:.2f} ms after {gap['after']}, before {gap['before']}")
    return out


# -----------------------------------------------------------------------------
# The suite


def guarded(errors: list, section: str, fn, *args):
    """Run one section of the suite; a failure is recorded and printed instead of losing the other sections."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (reported in the result, the traceback on stderr)
        traceback.print_exc()
        errors.append({"section": section, "error": f"{type(e).__name__}: {e}"[:2000]})
        return None


def run_suite(hp, preset, args, cache):
    """Every measurement of the suite (the compile section's persistent cache: `cache`, --compile-cache-dir,
    or None for a fresh one): returns (the JSON-able result, the table of rows)."""
    mesh = tg.make_mesh()
    rng = np.random.default_rng(0)
    table, errors = Table(args.peak_tflops), []
    device = jax.devices()[0]
    result = {"device": f"{mesh.size} x {device.device_kind} ({device.platform})", "jax": jax.__version__,
              "preset": preset, "attention": hp.attention, "dc": hp.dc, "mlp": hp.mlp, "head": hp.head,
              "model_dim": hp.model_dim, "vocab": hp.padded_vocab,
              "stages": [dataclasses.asdict(s) for s in hp.stages], "chunks_per_device": tg.RANKS // mesh.size,
              "peak_tflops": args.peak_tflops, "attention_implementations": sorted(tg.ATTENTION), "errors": errors}
    # the real train programs first, so that the device's peak memory is theirs
    trained = guarded(errors, "train and validation steps", train_rows, table, hp, mesh, rng, args.repeats)
    result["compile"], result["train_step"], result["memory"], train_state = trained or (None, None, None, None)
    if trained:
        result["compile"]["cache"] = cache

    params = tg.init_params(hp, 0)  # the model and its parts run on one device
    T_max = max(s.batch_size for s in hp.stages) // tg.RANKS
    inputs, targets = sample_chunks(rng, hp, 1, T_max)
    if "model" not in args.skip:
        guarded(errors, "model", model_rows, table, hp, params, inputs, targets, args.repeats)
    if "parts" not in args.skip:
        guarded(errors, "MLP and head", block_part_rows, table, hp, params, inputs[0], targets[0], rng, args.repeats)
        last = tg.stage_bounds(hp)[-2][0]  # the last scheduled stage: the largest chunk
        T = tg.stage_shape(last, hp)[0]
        windows = sorted({tuple(int(w) for w in tg.windows(first, hp)) for first, _ in tg.stage_bounds(hp)})
        for impl in sorted(tg.ATTENTION):
            guarded(errors, f"{impl} attention", attention_kernel_rows, table, hp, impl,
                    documents(inputs[:1, :T], hp.bos_id)[0], windows, rng, args.repeats)
        guarded(errors, "optimizer", optimizer_rows, table, hp, mesh, params, rng, args.repeats)
    result["rows"], result["skipped"], result["profile"] = table.rows, args.skip, None
    if trained and args.profile:
        result["profile"] = guarded(errors, "profile", profile_rows, train_state, args.profile)
    return result, table


def report_lines(result: dict, table: Table) -> list:
    """The suite's printed report: a header per section present, the table, the profile."""
    stages = ", ".join(f"{s['batch_size']:,}" for s in result["stages"])
    out = [f"bench suite: preset {result['preset']} (d={result['model_dim']}, vocab {result['vocab']:,}), batches "
           f"[{stages}] tokens as 8 chunks ({result['chunks_per_device']} per device), attention "
           f"{result['attention']}, dc {result['dc']}, mlp {result['mlp']}, head {result['head']}, {result['device']}, "
           f"jax {result['jax']}"]
    if result["compile"]:
        c, m, t = result["compile"], result["memory"], result["train_step"]
        peak = "n/a" if m["peak_mib"] is None else f"{m['peak_mib']:,.0f} MiB"
        by_stage = ", ".join(f"stage {k} {v:.1f} ms" for k, v in t["ms_by_stage"].items())
        first = (f"{c['first_s']:.1f}s cold (a fresh persistent cache)" if c["cache"] is None else
                 f"{c['first_s']:.1f}s with the persistent cache {c['cache']} ({c['first_loaded']} of {c['programs']} "
                 f"programs loaded from it)")
        warm = (f"{c['again_s']:.1f}s warm (the same cache after jax.clear_caches(): {c['again_loaded']} of "
                f"{c['programs']} programs loaded from it)" if c["again_s"] is not None else
                "so that was the warm compile (no second one)")
        out += [
            f"compile: the train programs and the validation step {first}, {warm}",
            f"memory: peak {peak} ({m['peak_source']}); compiled train program {m['compiled_peak_mib']:,.0f} MiB "
            f"({m['compiled_source']})",
            f"train step: {by_stage}; host loop {t['host_loop_ms']:.1f} ms/step; "
            f"{t['tokens_per_s_last_stage']:,.0f} tokens/s in the last stage; estimated run "
            f"{t['estimated_run_s']:.1f}s ({t['estimated_run_note']})",
        ]
    if result["skipped"]:
        out.append(f"left out (--skip): {', '.join(result['skipped'])}")
    out += [f"MFU against {result['peak_tflops']:.0f} TFLOP/s per device; GFLOP = useful FLOPs (see bench.py --help)",
            "", *table.lines()]
    if result["profile"]:
        out += ["", *profile_lines(result["profile"])]
    for e in result["errors"]:
        out.append(f"FAILED {e['section']}: {e['error'].splitlines()[0][:300]}")
    return out


# -----------------------------------------------------------------------------
# The Pallas kernels' tuning sweep: one row per configuration


ATTENTION_KERNELS, GEMM_KERNELS, DC_KERNELS = ("fwd", "dq", "dkv"), ("up", "dpre"), ("dc",)


def parse_sweep(text: str) -> list:
    """"fwd:128/8/2,dq:64/8/3,up:128x256x128/8/3,dc:16/4/1,..." -> [(kernel, KernelTuning or GemmTuning)];
    raises ValueError naming the bad item."""
    configs = []
    for item in text.split(","):
        try:
            kernel, knobs = item.split(":")
            tile, warps, stages = knobs.split("/")
            warps, stages = int(warps), int(stages)
            if warps < 1 or stages < 1:
                raise ValueError
            if kernel in ATTENTION_KERNELS or kernel in DC_KERNELS and int(tile) == tg.DC_ROWS:
                configs.append((kernel, tg.KernelTuning(int(tile), warps, stages)))
            elif kernel in GEMM_KERNELS:
                rows, cols, depth = (int(v) for v in tile.split("x"))
                if min(rows, cols, depth) < 16 or any(n & (n - 1) for n in (rows, cols, depth)):
                    raise ValueError
                configs.append((kernel, tg.GemmTuning(rows, cols, depth, warps, stages)))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"--sweep item {item!r}: write KERNEL:TILE/WARPS/STAGES with KERNEL fwd, dq or dkv "
                             f"(attention; TILE 16, 32, 64 or 128, e.g. fwd:128/8/2), up or dpre (the MLP's "
                             f"GEMMs; TILE ROWSxCOLSxDEPTH, powers of two from 16, e.g. "
                             f"up:128x256x128/8/3) or dc (the DC correction's three kernels; TILE {tg.DC_ROWS}, "
                             f"its queries a program, e.g. dc:{tg.DC_ROWS}/4/1)") from None
        if configs[-1] in configs[:-1]:
            raise ValueError(f"--sweep item {item!r} is listed twice: its row would hide the other")
    return configs


def tuning_name(kernel, tuning) -> str:
    """A sweep item's name as --sweep writes it."""
    if kernel in GEMM_KERNELS:
        return f"{kernel}:{tuning.rows}x{tuning.cols}x{tuning.depth}/{tuning.num_warps}/{tuning.num_stages}"
    return f"{kernel}:{tuning.tile}/{tuning.num_warps}/{tuning.num_stages}"


def dc_forward_backward(y, q, k, v, docs, w1, w2, scale, dout, tuning):
    """The DC correction's Pallas kernels as a train step runs them: the forward, then the backward from its
    log-sum-exp (the sweep's dc items; tests/gpu/aot.py's too)."""
    out, lse = tg._pallas_dc_forward(y, q, k, v, docs, w1, w2, scale, tuning=tuning)
    return out, tg._pallas_dc_backward(q, k, v, docs, w1, w2, scale, lse, dout, tuning=tuning)


def gemm_sweep_inputs(rng, hp, T):
    """The GEMM kernels' operands at T tokens: {kernel: (function, arguments, FLOPs)}."""
    D, F = hp.model_dim, 4 * hp.model_dim
    e4m3 = lambda *shape: jnp.asarray(rng.uniform(-448, 448, shape), jnp.float32).astype(tg.E4M3)  # noqa: E731
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
    return {"up": (tg.pallas_mlp_up, (e4m3(T, D), e4m3(F, D), jnp.float32(1e-5), jnp.float32(0.01), jnp.ones(T, bool)),
                   2 * T * D * F),
            "dpre": (tg.pallas_mlp_dpre, (normal(T, D), normal(F, D),
                                          jnp.asarray(rng.uniform(0, 4, (T, F)), jnp.bfloat16)), 2 * T * D * F)}


def sweep_rows(table, hp, configs, repeats, rounds):
    """Each configuration's kernel at the last stage's chunk (6 heads), at its short and long window:
    fwd alone for the forward kernel; the backward (dq and dk/dv kernels, the other at its default)
    for dq and dkv; up and dpre (the MLP's kernels) on the chunk's tokens at the model's width; dc, the DC
    correction's forward and backward kernels, on the chunk. Everything compiles first; then `rounds`
    rounds each time every measurement once (`repeats` calls, their median), so that a drift of the
    device's clocks reaches every row alike: a row is the median of its rounds, the rounds' times go in its
    note. Returns (errors, {row: ms per round}); a configuration that fails to compile or run is reported
    and the others go on."""
    rng = np.random.default_rng(0)
    first = tg.stage_bounds(hp)[-2][0]
    T, H, K = tg.stage_shape(first, hp)[0], tg.NUM_HEADS, hp.head_dim
    inputs, _ = sample_chunks(rng, hp, 1, T)
    docs_T = documents(inputs, hp.bos_id)[0]
    docs = jnp.asarray(docs_T, jnp.int32)
    q, k, v, dout = (jnp.asarray(rng.standard_normal((T, H, K)), jnp.bfloat16) for _ in range(4))
    scale = jnp.float32(0.1)
    errors = []

    def failed(name, e):
        errors.append({"section": name, "error": f"{type(e).__name__}: {e}"[:2000]})
        print(f"bench: {name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)

    gemms = gemm_sweep_inputs(rng, hp, T) if any(k in GEMM_KERNELS for k, _ in configs) else {}
    notes = {"up": "MLP up projection, FP8", "dpre": "MLP dpre, bf16"}
    rows = []  # (row name, compiled, call arguments, Table.add's keywords)
    for kernel, tuning in configs:
        name = f"pallas {tuning_name(kernel, tuning)}"
        try:
            if kernel in GEMM_KERNELS:  # one GEMM and its epilogue
                kernel_fn, args, flops = gemms[kernel]
                compiled, compile_s = compile_timed(jax.jit(lambda *a, f=kernel_fn, t=tuning: f(*a, tuning=t)), *args)
                rows.append((name, compiled, args, dict(tokens=len(args[0]), flops=flops, compile_s=compile_s,
                                                        note=notes[kernel])))
                continue
            if kernel in DC_KERNELS:  # forward then backward, as a train step runs them
                w1, w2 = (jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16) for _ in range(2))
                args = (dout, q, k, v, docs, w1, w2, scale, dout)  # (y: any bf16 values)
                program = jax.jit(lambda *a, t=tuning: dc_forward_backward(*a, tuning=t))
                compiled, compile_s = compile_timed(program, *args)
                rows.append((name, compiled, args, dict(tokens=T, flops=dc_flops(docs_T, K), compile_s=compile_s,
                                                        note="DC correction: forward + backward")))
                continue
            # the arrays are arguments, not constants baked into the program
            if kernel == "fwd":
                fn = jax.jit(lambda q, k, v, docs, w, t=tuning: tg._pallas_forward(q, k, v, docs, w, scale, t))
                args = (q, k, v, docs)
            else:
                out, lse = jax.jit(lambda q, k, v, docs: tg._pallas_forward(q, k, v, docs, 1, scale))(q, k, v, docs)
                knobs = {"dq_tuning": tuning} if kernel == "dq" else {"dkv_tuning": tuning}
                fn = jax.jit(lambda q, k, v, docs, out, lse, dout, w, kw=knobs: tg._pallas_backward(
                    q, k, v, docs, w, scale, out, lse, dout, **kw))
                args = (q, k, v, docs, out, lse, dout)
            compiled, compile_s = compile_timed(fn, *args, jnp.int32(1))
            per_pair = 4 if kernel == "fwd" else 8
            for w in sorted({int(x) for x in tg.windows(first, hp)}):
                rows.append((f"{name} W={w}", compiled, (*args, jnp.int32(w)),
                             dict(tokens=T, flops=per_pair * K * H * attention_pairs(docs_T, w), compile_s=compile_s,
                                  note="forward kernel" if kernel == "fwd" else "backward: dq + dk/dv kernels")))
        except Exception as e:  # noqa: BLE001  (a configuration Triton rejects is a row, not the end)
            failed(name, e)
    times = {name: [] for name, *_ in rows}
    for r in range(rounds):
        for name, compiled, args, _ in rows:
            if name not in times:  # it failed in an earlier round
                continue
            try:
                times[name].append(seconds_per_call(compiled, args, repeats, warm_up=r == 0))
            except Exception as e:  # noqa: BLE001
                failed(name, e)
                del times[name]
                continue
            # progress, kept if a later round dies or a time limit cuts the sweep
            print(f"bench: {name} round {r + 1}: {times[name][-1] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    for name, compiled, args, row in rows:
        if name in times:
            spread = ", ".join(f"{t * 1e3:.2f}" for t in times[name])
            table.add(name, float(np.median(times[name])), compiled=compiled,
                      **{**row, "note": f"{row['note']}; rounds {spread} ms"})
    return errors, {name: [t * 1e3 for t in ts] for name, ts in times.items()}


# -----------------------------------------------------------------------------
# The single benchmark and the command line


def model_mode(hp, args):
    """The model's forward+backward of one chunk at each stage shape."""
    rng = np.random.default_rng(0)
    T_max = max(s.batch_size for s in hp.stages) // tg.RANKS
    inputs, targets = sample_chunks(rng, hp, 1, T_max)
    table = Table(args.peak_tflops)
    model_rows(table, hp, tg.init_params(hp, 0), inputs, targets, args.repeats)
    return table


def profile_mode(hp, args):
    """The profile alone: the train program of stage --stage (default: the last program's) compiled by
    itself (or loaded from --compile-cache-dir), a warm-up step, then PROFILE_STEPS traced steps and
    their top device ops and source lines."""
    mesh = tg.make_mesh()
    state = tg.initial_state(hp, mesh)
    prefix_V = jax.device_put(tg.prefix_table(hp.padded_vocab), NamedSharding(mesh, P()))
    first = tg.program_steps(hp)[-1] if args.stage is None else tg.stage_bounds(hp)[args.stage][0]
    shape = tg.stage_shape(first, hp)
    lowered = tg.trace_train_step(hp, mesh, first, *state, prefix_V).lower()
    t0 = time.perf_counter()
    with tg.CacheHits() as hits:
        program = lowered.compile()
    compile_s = time.perf_counter() - t0
    _, x, y, step_inputs = stage_batch(np.random.default_rng(0), hp, mesh, first)
    state, _ = run_train_steps(program, state, x, y, step_inputs, prefix_V, 1)  # warm-up
    profile = profile_rows((program, state, x, y, step_inputs, prefix_V), args.profile)
    return {"stage": tg.stage_of(first, hp)[0], "chunk": shape[0], "mtp_terms": shape[1], "compile_s": compile_s,
            "loaded_from_cache": hits.count == 1, "profile": profile}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--suite", action="store_true", help="the whole picture: compile, train steps, model, parts")
    mode.add_argument("--sweep", metavar="CONFIGS", help="the Pallas kernels' tuning: KERNEL:TILE/WARPS/STAGES items, "
                      "comma-separated: attention KERNEL fwd, dq or dkv, TILE 16-128, each timed at the last stage's "
                      "windows; the MLP's GEMM kernels' KERNEL up or dpre, TILE ROWSxCOLSxDEPTH, timed on "
                      "the last stage's chunk; the DC correction's kernels' KERNEL dc, TILE 16, forward and backward "
                      "on the chunk; e.g. fwd:128/8/2,dq:64/8/2,up:128x256x128/8/3,dpre:128x128x64/4/4,dc:16/4/1")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="default: record on a GPU, tiny elsewhere; smoke: the quickest check that the suite runs")
    parser.add_argument("--attention", default="auto", choices=["auto", *sorted(tg.ATTENTION)],
                        help="attention implementation of the model, as in train_gpt.py (default auto: "
                        f"{tg.AUTO_ON_GPU['attention']} on GPUs, xla elsewhere)")
    parser.add_argument("--dc", default="auto", choices=["auto", *sorted(tg.ADD_DC_CORRECTION)],
                        help="layer 10's DC correction in the model, as in train_gpt.py (default auto: "
                        f"{tg.AUTO_ON_GPU['dc']} on GPUs (train_gpt.AUTO_ON_GPU), xla elsewhere; the suite's DC rows "
                        "time each)")
    parser.add_argument("--mlp", default="auto", choices=["auto", *tg.GEMM_IMPLEMENTATIONS],
                        help="the FP8 MLP's implementation in the model, as in train_gpt.py (default auto: "
                        f"{tg.AUTO_ON_GPU['mlp']} on GPUs, xla elsewhere; the suite's one-layer MLP rows time each)")
    parser.add_argument("--head", default="auto", choices=["auto", *tg.GEMM_IMPLEMENTATIONS],
                        help="the FP8 head's implementation in the model, as in train_gpt.py (default auto: "
                        f"{tg.AUTO_ON_GPU['head']} on GPUs (train_gpt.AUTO_ON_GPU), xla elsewhere; the suite's head "
                        "rows time each)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median; default 3)")
    parser.add_argument("--rounds", type=int, help="with --sweep: time every configuration once per round, round after "
                        "round, and give each row the median of its rounds (default 3)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per-device peak for MFU (default 989)")
    parser.add_argument("--profile", metavar="DIR", help="trace train steps of the last stage into DIR and list the top "
                        "device ops and source lines: with --suite, as its last section; alone, the quickest look (that "
                        "program compiled by itself, nothing else measured)")
    parser.add_argument("--compile-cache-dir", metavar="DIR", help="with --profile alone or --suite: JAX's "
                        "persistent compile cache there, so that a program train_gpt.py compiled there (same shapes: "
                        "preset and stage flags; same attention, MLP and head) is loaded, not compiled again (default: "
                        "none for the profile; the suite starts a fresh one, so that its first compile is cold; ''"
                        " as none)")
    parser.add_argument("--skip", metavar="SECTIONS", default="", help="with --suite: leave these sections out, "
                        "comma-separated: model (its forward+backward rows, which `python bench.py` runs alone), "
                        "parts (the attention, MLP, head and optimizer rows); e.g. --skip model saves a compile per "
                        "stage shape")
    parser.add_argument("--stage", type=int, metavar="K", help="with --profile alone: the train program of stage K "
                        "(counted from 0, as train_gpt.py's stage table; default: the last program's, the largest chunk)")
    parser.add_argument("--out", metavar="PATH", help="also write the table and the JSON line to PATH")
    args = parser.parse_args(argv)
    profile_alone = args.profile and not args.suite
    if args.stage is not None and not profile_alone:
        parser.error("--stage goes with --profile alone (the suite measures every stage)")
    if args.profile and args.sweep:
        parser.error("--profile goes with --suite or alone, not with --sweep")
    if args.compile_cache_dir is not None and not (args.suite or args.profile):
        parser.error("--compile-cache-dir goes with --profile or --suite")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    if args.rounds is not None and not args.sweep:
        parser.error("--rounds goes with --sweep")
    args.rounds = 3 if args.rounds is None else args.rounds
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be at least 1")
    args.skip = [x for x in args.skip.split(",") if x]
    unknown = [x for x in args.skip if x not in SUITE_SECTIONS]
    if unknown:
        parser.error(f"--skip {','.join(unknown)}: the sections that can be left out are {', '.join(SUITE_SECTIONS)}")
    if args.skip and not args.suite:
        parser.error("--skip goes with --suite")
    if args.sweep:
        try:
            args.sweep = parse_sweep(args.sweep)
        except ValueError as e:
            parser.error(str(e))
    return args


def write_out(path: str, text: str) -> None:
    """Write whole or not at all: a temporary file renamed over the target."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    tg.backend_defaults()  # as a training run starts (the suite runs every stage's program in one process)
    try:
        if args.out:  # fail now, not after the benchmarks
            folder = os.path.dirname(os.path.abspath(args.out))
            os.makedirs(folder, exist_ok=True)
            if os.path.isdir(args.out) or not os.access(folder, os.W_OK):
                raise OSError(f"--out {args.out}: cannot write a file there")
        preset = args.preset or ("record" if jax.default_backend() == "gpu" else "tiny")
        hp = dataclasses.replace(PRESETS[preset], **{name: tg.auto_implementation(name) if getattr(args, name) == "auto"
                                                     else getattr(args, name) for name in tg.AUTO_FIELDS})
        if args.stage is not None and not 0 <= args.stage < len(hp.stages):
            raise ValueError(f"--stage {args.stage}: preset {preset} has stages 0 to {len(hp.stages) - 1}")
        if (args.suite or args.profile) and tg.RANKS % jax.device_count():
            raise ValueError(f"the step's {tg.RANKS} chunks do not split evenly over {jax.device_count()} devices: "
                             f"use 1, 2, 4 or 8")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.suite:
        given = args.compile_cache_dir or None  # '' as none: a fresh one
        cache_dir = given or tempfile.mkdtemp(prefix="bench-compile-cache-")
        tg.enable_compile_cache(cache_dir)  # before anything compiles: JAX reads the setting once
        try:
            result, table = run_suite(hp, preset, args, given)
        finally:
            if given is None:
                shutil.rmtree(cache_dir, ignore_errors=True)
        lines = report_lines(result, table)
    elif args.sweep:
        table = Table(args.peak_tflops)
        errors, rounds = sweep_rows(table, hp, args.sweep, args.repeats, args.rounds)
        result = {"preset": preset, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": table.rows,
                  "rounds_ms": rounds, "errors": errors}
        lines = [f"Pallas tuning sweep: preset {preset}, {result['device']}, jax {jax.__version__}; each row the median "
                 f"of {args.rounds} rounds of {args.repeats} calls, every row timed once a round", *table.lines(),
                 *(f"FAILED {e['section']}: {e['error'].splitlines()[0][:300]}" for e in errors)]
    elif args.profile:
        tg.enable_compile_cache(args.compile_cache_dir)  # before anything compiles: JAX reads the setting once
        result = {"preset": preset, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                  "attention": hp.attention, "dc": hp.dc, "mlp": hp.mlp, "head": hp.head, **profile_mode(hp, args)}
        got = "loaded from the persistent compile cache" if result["loaded_from_cache"] else "compiled alone"
        lines = [f"profile: preset {preset}, stage {result['stage']}'s train program (chunks of {result['chunk']:,}, "
                 f"{result['mtp_terms']} MTP weights, attention {hp.attention}, dc {hp.dc}, mlp {hp.mlp}, "
                 f"head {hp.head}) {got} in {result['compile_s']:.1f}s, {result['device']}, jax {jax.__version__}",
                 *profile_lines(result["profile"])]
    else:
        table = model_mode(hp, args)
        result = {"preset": preset, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": table.rows}
        lines = [f"preset {preset}, {result['device']}, jax {jax.__version__}", *table.lines()]
    text = "\n".join(lines) + "\n" + json.dumps(result) + "\n"
    print(text, end="")
    if args.out:
        write_out(args.out, text)
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
