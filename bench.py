"""Where the time goes: benchmarks of train_gpt.py's pieces on the current JAX backend.

  python bench.py --suite [--profile DIR] [--out PATH]  # the whole picture: one table, then one JSON line
  python bench.py                                       # model forward+backward of one sequence
  python bench.py --attention pallas                    # the same with another attention implementation
  python bench.py --attention-layer                     # each attention implementation alone at windows
                                                        # 1, 7, 14 blocks, then the model with each

Shapes: the record preset on a GPU; elsewhere `tiny` (6 layers, d=128, vocabulary 8,192, 1,024-token
sequences, 2 per step): the suite takes ~1.5 minutes of CPU time, most of it compiling. `--preset
smoke` is the smallest shape that still runs every section (vocabulary 1,024, two 256-token
sequences, windows of 1 and 2 blocks): a check that the suite works, its numbers mean nothing.
--preset and --seq-len override.

The suite measures
  compile     seconds to trace, lower and compile the train and validation steps, cold (a fresh
              persistent cache) and warm (the same cache again after jax.clear_caches());
  train step  the step train() runs (each device scans its share of the step's sequences) at window 1
              and at the full window: synced every step as train() does, and pipelined (the
              difference is the host loop's cost); the preset's whole run estimated from the two;
  model       forward+backward of one sequence at windows 1 and full, FP8 and bf16 head;
  parts       forward+backward of each part alone at the same shape: embeddings + value embeddings,
              the attention kernel of each implementation (windows 1, 7, 14), one attention layer
              (projections, norms, rotary, kernel) of each, one MLP, head + loss (FP8, bf16); the
              optimizer update (all groups; Muon alone); the validation step; and a breakdown of the
              train step into them (an estimate: parts compiled alone fuse differently);
  memory      peak device memory after the train step (device memory_stats; n/a on CPU) and XLA's
              buffer-assignment peak of the compiled train step (memory_analysis);
  profile     with --profile DIR: a jax.profiler trace of a few train steps at the full window and
              the top 15 device ops by self time (on CPU the XLA:CPU thunks).

FLOPs. "GFLOP" is useful work counted analytically: 2 per multiply-add of every matmul, x3 for
forward+backward; attention counts the (query, key) pairs its rule allows for the actual documents
and window (4·D FLOPs per pair forward, 8·D backward), never masked work. MFU = those TFLOP/s over
--peak-tflops (default 989: H100 SXM dense bf16) times the devices used. "MFU nom." uses the count
bench.py has always used (6 per matmul weight per token + 12·D·(W - 1/2)·128 per attention layer,
documents ignored); compare that one with PyTorch numbers. "XLA GFLOP" is XLA's cost analysis,
which counts a loop body once and a custom call (a Pallas kernel) as 0: rows whose program has a
while loop are marked `loop`, and their XLA number is not the work done.
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
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import train_gpt as tg

# CPU-sized: the head dominates a small model's time on CPU, so a 8,192-token vocabulary (no <|endoftext|>:
# each sequence is one document)
TINY = dataclasses.replace(tg.PRESETS["record"], num_layers=6, model_dim=128, num_heads=1, vocab_size=8192,
                           seq_len=1024, batch_size=2048, val_tokens=2048)
SMOKE = dataclasses.replace(TINY, vocab_size=1024, seq_len=256, batch_size=512, val_tokens=512, window_tokens=256)
PRESETS = {**tg.PRESETS, "tiny": TINY, "smoke": SMOKE}
KERNEL_WINDOWS = (1, 7, 14)
PROFILE_STEPS = 3
TOP_OPS = 15
EOT_RATE = 1 / 1000  # documents of ~1,000 tokens, like FineWeb's


# -----------------------------------------------------------------------------
# FLOP counting (analytic)


def matmul_weights(hp) -> int:
    """Weights used in a matmul once per token: attention q, k, v, o; MLP; head. Embeddings are lookups."""
    D, L = hp.model_dim, hp.num_layers
    attention_layers = sum(tg.has_attention(i, L) for i in range(L))
    return attention_layers * 4 * D * D + L * 8 * D * D + hp.padded_vocab * D


def layer_windows(hp, window: int) -> list:
    """The window (blocks) of each attention layer when the long window is `window`, as gpt_hidden sets them."""
    L = hp.num_layers
    return [max(window if tg.has_long_window(i, L) else window // 2, 1) for i in range(L) if tg.has_attention(i, L)]


def nominal_flops(hp, T: int, window: int) -> float:
    """bench.py's classic count for one sequence forward+backward: documents ignored, (W - 1/2)·128 keys per query."""
    n_blocks = T // tg.BLOCK
    attended = sum((min(w, n_blocks) - 0.5) * tg.BLOCK for w in layer_windows(hp, window))
    return (6 * matmul_weights(hp) + 12 * hp.model_dim * attended) * T


def _lowest_keys(docs_T, window: int):
    """For each query, its lowest allowed key: the later of its document's start and its window's first block."""
    T = len(docs_T)
    q = np.arange(T)
    new_doc = np.r_[True, docs_T[1:] != docs_T[:-1]]
    doc_start = np.maximum.accumulate(np.where(new_doc, q, 0))
    return np.maximum(doc_start, (q // tg.BLOCK - max(window, 1) + 1) * tg.BLOCK)


def attention_pairs(docs_T, window: int) -> int:
    """(q, k) pairs allowed by k <= q, same document, floor(q/128) - floor(k/128) < max(window, 1)."""
    return int(np.sum(np.arange(len(docs_T)) - _lowest_keys(np.asarray(docs_T), window) + 1))


def attention_blocks(docs_T, window: int) -> int:
    """128x128 (query block, key block) tiles holding at least one allowed pair: what a kernel must visit."""
    n_blocks = len(docs_T) // tg.BLOCK
    lowest = _lowest_keys(np.asarray(docs_T), window).reshape(n_blocks, tg.BLOCK).min(axis=1)
    return int(np.sum(np.arange(n_blocks) - lowest // tg.BLOCK + 1))


def model_flops(hp, docs_RxT, window: int, backward: bool = True) -> float:
    """Useful FLOPs of the model on these sequences: matmuls plus the allowed attention pairs."""
    per_pair = (12 if backward else 4) * hp.model_dim
    pairs = sum(attention_pairs(docs, w) for docs in docs_RxT for w in layer_windows(hp, window))
    return (6 if backward else 2) * matmul_weights(hp) * docs_RxT.size + per_pair * pairs


def newton_schulz_flops(shapes, steps: int = 5) -> int:
    """NS5 on each matrix (made wide, m <= n): per step X·Xᵀ (2m²n), A·A (2m³), B·X (2m²n)."""
    total = 0
    for *stack, a, b in shapes:
        m, n = min(a, b), max(a, b)
        total += math.prod(stack) * steps * (4 * m * m * n + 2 * m**3)
    return total


def is_muon(name: str, p) -> bool:
    return name.startswith("blocks.") and p.ndim >= 2  # the matrices inside the blocks


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


def sample_tokens(rng, shape, hp):
    """Random token ids with <|endoftext|> at rate 1/1000 (if the vocabulary has it); shape (..., T + 1)."""
    tokens = rng.integers(0, hp.vocab_size, shape)
    if tg.EOT < hp.vocab_size:
        tokens[rng.random(shape) < EOT_RATE] = tg.EOT
    return tokens.astype(np.int32)


def documents(inputs):
    """Document index of each token, as gpt_hidden computes it (an <|endoftext|> opens a document)."""
    return np.cumsum(inputs == tg.EOT, axis=-1)


def random_like(rng, tree):
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), tree)


def fwd_bwd(f, n_diff: int):
    """Jitted forward + backward of f with respect to its first n_diff arguments; the cotangent comes last."""

    def run(*args):
        *args, cotangent = args
        _, vjp = jax.vjp(lambda *diff: f(*diff, *args[n_diff:]), *args[:n_diff])
        return vjp(cotangent)

    return jax.jit(run)


# -----------------------------------------------------------------------------
# The suite's parts


def time_part(table, name, f, args, n_diff, rng, repeats, *, windows=None, flops=None, tokens=None, note=""):
    """Compile f's forward+backward once and time it (at each window, passed as the last argument of f)."""
    example = (*args, jnp.int32(windows[0])) if windows else args
    cotangent = random_like(rng, jax.eval_shape(f, *example))
    compiled, compile_s = compile_timed(fwd_bwd(f, n_diff), *example, cotangent)
    for i, window in enumerate(windows or [None]):
        call_args = (*args, jnp.int32(window), cotangent) if windows else (*args, cotangent)
        sec = seconds_per_call(compiled, call_args, repeats, warm_up=i == 0)
        label = f"{name} w={window}" if windows else name
        table.add(label, sec, tokens=tokens, flops=flops(window) if callable(flops) else flops, compiled=compiled,
                  compile_s=compile_s, note=note(window) if callable(note) else note)


def attention_kernel_rows(table, hp, impl, docs_T, rng, repeats, windows=KERNEL_WINDOWS):
    T, H = len(docs_T), hp.num_heads
    q, k, v = (jnp.asarray(rng.standard_normal((T, H, tg.HEAD_DIM)), jnp.bfloat16) for _ in range(3))
    docs = jnp.asarray(docs_T, jnp.int32)

    def note(w):
        return (f"{attention_pairs(docs_T, w) / T:.0f} keys/query, {attention_blocks(docs_T, w)} non-empty tiles "
                f"of {min(w, T // tg.BLOCK) * (T // tg.BLOCK)} in window")

    time_part(table, f"attention kernel {impl}", lambda q, k, v, docs, w: tg.ATTENTION[impl](q, k, v, docs, w),
              (q, k, v, docs), 3, rng, repeats, windows=windows, tokens=T,
              flops=lambda w: 12 * hp.model_dim * attention_pairs(docs_T, w), note=note)


def attention_layer_rows(table, hp, impl, params, docs_T, rng, repeats, windows):
    """Layer 0 (long window, value embeddings): qkv projection, QK-norm, rotary, kernel, output projection."""
    T, D = len(docs_T), hp.model_dim
    names = ["blocks.0.attn.qkv_w", "blocks.0.attn.lambdas", "blocks.0.attn.c_proj.weight"]
    x, ve = (jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16) for _ in range(2))
    cos, sin = tg.rotary_cos_sin(T)

    def layer(x, ve, qkv_w, lambdas, c_proj, docs, cos, sin, w):
        p = dict(zip(names, (qkv_w, lambdas, c_proj)))
        return tg.causal_self_attention(p, 0, x, ve, docs, w, cos, sin, tg.ATTENTION[impl])

    time_part(table, f"attention layer {impl}", layer,
              (x, ve, *(params[n] for n in names), jnp.asarray(docs_T, jnp.int32), cos, sin), 5, rng, repeats,
              windows=windows, tokens=T, flops=lambda w: 6 * 4 * D * D * T + 12 * D * attention_pairs(docs_T, w))


def block_part_rows(table, hp, params, inputs_T, targets_T, rng, repeats):
    """Embeddings + value embeddings, one MLP, head + loss with each head."""
    T, D = len(inputs_T), hp.model_dim
    inputs, targets = jnp.asarray(inputs_T), jnp.asarray(targets_T)
    tables = [params["embed.weight"]] + [params[f"value_embeds.embed.{k}.weight"] for k in range(3)]

    def embed(e, v0, v1, v2, tokens):
        return tg.rms_norm(e[tokens]), v0[tokens], v1[tokens], v2[tokens]

    time_part(table, "embeddings + value embeddings", embed, (*tables, inputs), 4, rng, repeats, tokens=T,
              note="gathers + scatter-adds: memory-bound, no matmul FLOPs")
    mlp_names = ["blocks.0.mlp.c_fc.weight", "blocks.0.mlp.c_proj.weight"]
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    time_part(table, "MLP (one layer)", lambda x, fc, proj: tg.mlp(dict(zip(mlp_names, (fc, proj))), 0, x),
              (x, *(params[n] for n in mlp_names)), 3, rng, repeats, tokens=T, flops=6 * 8 * D * D * T)
    h = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((hp.padded_vocab, D)) * D**-0.5, jnp.float32)
    for fp8 in (True, False):
        time_part(table, f"head + loss {'fp8' if fp8 else 'bf16'}",
                  lambda h, w, t, fp8=fp8: tg.head_loss(h, w, t, fp8), (h, w, targets), 2, rng, repeats, tokens=T,
                  flops=6 * hp.padded_vocab * D * T, note="backward recomputes the logits (not counted)")


def optimizer_rows(table, hp, mesh, params, rng, repeats):
    """The whole optimizer update (Adam groups + Muon), then Muon alone on the block matrices."""
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    grads = jax.device_put(random_like(rng, params), replicated)
    ns_flops = newton_schulz_flops(p.shape for n, p in params.items() if is_muon(n, p))

    def update(optimizer, params, grads):
        def step(params, state, grads):
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state = jax.jit(optimizer.init, out_shardings=replicated)(params)
        compiled, compile_s = compile_timed(jax.jit(step), params, state, grads)
        return compiled, compile_s, seconds_per_call(compiled, (params, state, grads), repeats)

    compiled, compile_s, sec = update(tg.make_optimizer(hp, mesh), params, grads)
    table.add("optimizer update (Adam + Muon)", sec, flops=ns_flops, compiled=compiled, compile_s=compile_s,
              devices=mesh.size, note="FLOPs: Newton-Schulz only (Adam is elementwise)")
    muon = tg.muon(lambda step: hp.muon_lr, lambda step: 0.95, mesh)
    subset = {n: p for n, p in params.items() if is_muon(n, p)}
    compiled, compile_s, sec = update(muon, subset, {n: grads[n] for n in subset})
    table.add("optimizer: Muon alone", sec, flops=ns_flops, compiled=compiled, compile_s=compile_s,
              devices=mesh.size, note=f"{len(subset)} matrices, NS5 in bf16")


def model_rows(table, hp, params, inputs_T, targets_T, docs_T, repeats, windows, heads, attention):
    """The whole model's loss and gradients for one sequence, compiled once per head, timed at each window."""
    T = len(inputs_T)
    inputs, targets = jnp.asarray(inputs_T), jnp.asarray(targets_T)
    for fp8 in heads:
        def loss_and_grads(params, inputs, targets, window, fp8=fp8):
            return jax.value_and_grad(tg.loss_fn)(params, inputs, targets, window, True, fp8, attention)

        compiled, compile_s = compile_timed(jax.jit(loss_and_grads), params, inputs, targets, jnp.int32(1))
        for i, window in enumerate(windows):
            sec = seconds_per_call(compiled, (params, inputs, targets, jnp.int32(window)), repeats, warm_up=i == 0)
            table.add(f"model fwd+bwd {attention} w={window} {'fp8' if fp8 else 'bf16'}", sec, tokens=T,
                      flops=model_flops(hp, docs_T[None], window), nominal=nominal_flops(hp, T, window),
                      compiled=compiled, compile_s=compile_s)


# -----------------------------------------------------------------------------
# The train and validation steps as train() builds them


def build_steps(hp, mesh):
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    optimizer = tg.make_optimizer(hp, mesh)
    params, opt_state = tg.initial_state(hp, mesh, optimizer)
    train_step, val_step = tg.make_steps(hp, mesh, optimizer)
    batch = jax.ShapeDtypeStruct((hp.batch_size // hp.seq_len, hp.seq_len), jnp.int32, sharding=rows)
    window = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return train_step, val_step, params, opt_state, batch, window


def compile_cold_and_warm(train_step, val_step, params, opt_state, batch, window):
    """Compile both steps into an empty persistent cache, forget them in memory, compile them again."""
    seconds = {}
    for kind in ("cold", "warm"):
        if kind == "warm":
            jax.clear_caches()
        train, seconds[f"train_{kind}_s"] = compile_timed(train_step, params, opt_state, batch, batch, window)
        val, seconds[f"val_{kind}_s"] = compile_timed(val_step, params, batch, batch, window)
    return train, val, seconds


def run_train_steps(step, state, inputs, targets, window, n, synced=True):
    """n train steps chained like train()'s loop (parameters are donated); returns (state, seconds per step)."""
    params, opt_state = state
    window = np.int32(window)
    t0 = time.perf_counter()
    for _ in range(n):
        params, opt_state, loss = step(params, opt_state, inputs, targets, window)
        if synced:
            float(loss)  # train() reads every step's loss
    float(loss)
    return (params, opt_state), (time.perf_counter() - t0) / n


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
        "compiled_source": "XLA buffer assignment of the compiled train step (memory_analysis)",
    }


def estimated_run_s(hp, ms_at_1: float, ms_at_max: float) -> float:
    """The preset's training time: each step's window, its step time interpolated linearly between the two."""
    top = tg.window_blocks(hp.num_iterations, hp)
    return sum(ms_at_1 + (ms_at_max - ms_at_1) * (tg.window_blocks(s, hp) - 1) / max(top - 1, 1)
               for s in range(hp.num_iterations)) / 1e3


def breakdown(hp, rows, per_device, w, train_ms) -> list:
    """The train step at window w split into its parts' standalone times (x how often each runs per device)."""
    head = "fp8" if hp.fp8_head else "bf16"
    layers = sum(rows[f"attention layer {hp.attention} w={lw}"]["ms"] for lw in layer_windows(hp, w))
    parts = [
        ("embeddings + value embeddings", per_device * rows["embeddings + value embeddings"]["ms"]),
        (f"attention layers ({len(layer_windows(hp, w))})", per_device * layers),
        (f"MLPs ({hp.num_layers})", per_device * hp.num_layers * rows["MLP (one layer)"]["ms"]),
        (f"head + loss {head}", per_device * rows[f"head + loss {head}"]["ms"]),
        ("optimizer update", rows["optimizer update (Adam + Muon)"]["ms"]),
    ]
    parts.append(("rest (norms, skips, scan, all-reduce, fusion differences)", train_ms - sum(ms for _, ms in parts)))
    return [{"part": name, "ms": ms, "pct_of_step": 100 * ms / train_ms} for name, ms in parts]


# -----------------------------------------------------------------------------
# Profile: top device ops from the trace jax.profiler writes (DIR/plugins/profile/<run>/<host>.trace.json.gz)

DERIVED_LINES = {"XLA Modules", "Steps", "Framework Ops", "Framework Name Scope", "Source code", "TensorFlow Ops",
                 "TensorFlow Name Scope", "Launch Stats"}
HLO_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*?op_name="([^"]+)"', re.M)


def profile_train(step, state, inputs, targets, window, trace_dir):
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    if jax.default_backend() == "cpu":
        options.host_tracer_level = 3  # XLA:CPU records its thunks (the ops) only at the verbose level
    with jax.profiler.trace(trace_dir, profiler_options=options):
        state, sec = run_train_steps(step, state, inputs, targets, window, PROFILE_STEPS)
    return state, sec


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


def self_times(events: list) -> list:
    """(event, its duration minus that of the events nested inside it on the same line), e.g. a while
    loop's own time without its body's ops."""
    by_line = defaultdict(list)
    for e in events:
        by_line[(e["pid"], e["tid"])].append(e)
    out = []
    for line in by_line.values():
        line.sort(key=lambda e: (e["ts"], -e["dur"]))
        own = [e["dur"] for e in line]
        open_events = []  # (end, index) of the events enclosing the current one
        for i, e in enumerate(line):
            while open_events and open_events[-1][0] <= e["ts"]:
                open_events.pop()
            if open_events:
                own[open_events[-1][1]] -= e["dur"]
            open_events.append((e["ts"] + e["dur"], i))
        out += [(e, max(t, 0.0)) for e, t in zip(line, own)]
    return out


def top_device_ops(trace_path: str, steps: int, step_ms: float, hlo_text: str = "", k: int = TOP_OPS) -> dict:
    """The k device ops with the most self time: count and ms per step, % of the profiled step time."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    jax_names = dict(HLO_OP_NAME.findall(hlo_text))
    total_us, count, kernel = defaultdict(float), defaultdict(int), {}
    for e, own_us in self_times(device_op_events(events)):
        op = e.get("args", {}).get("hlo_op") or e["name"]
        total_us[op] += own_us
        count[op] += 1
        kernel.setdefault(op, e["name"])
    ops = [{"op": op, "kernel": kernel[op] if kernel[op] != op else None, "jax_op": jax_names.get(op),
            "count": count[op] / steps, "ms": total_us[op] / 1e3 / steps,
            "pct_of_step": 100 * total_us[op] / 1e3 / steps / step_ms}
           for op in sorted(total_us, key=total_us.get, reverse=True)[:k]]
    busy_ms = sum(total_us.values()) / 1e3 / steps
    return {"trace": trace_path, "steps": steps, "step_ms": step_ms, "device_busy_ms": busy_ms,
            "device_busy_pct": 100 * busy_ms / step_ms, "top_ops": ops}


def short_op_name(op_name: str, width: int = 70) -> str:
    """The end of a JAX op path that fits in width, without the outer jit(...) scope."""
    parts = [p for p in op_name.split("/") if not p.startswith("jit(")]
    kept = []
    while parts and len("/".join([parts[-1], *kept])) <= width:
        kept.insert(0, parts.pop())
    return ("…/" if parts else "") + "/".join(kept)


def profile_lines(profile: dict) -> list:
    out = [f"profile: {profile['steps']} train steps, {profile['step_ms']:.1f} ms/step under the profiler; device ops "
           f"{profile['device_busy_ms']:.1f} ms/step ({profile['device_busy_pct']:.0f}% of the step, more where ops "
           f"overlap); trace {profile['trace']}",
           f"{'op':<36}{'count':>8}{'ms':>10}{'% step':>8}  jax op (or kernel)"]
    for op in profile["top_ops"]:
        where = short_op_name(op["jax_op"]) if op["jax_op"] else (op["kernel"] or "")[:70]
        out.append(f"{op['op'][:36]:<36}{op['count']:>8.4g}{op['ms']:>10.2f}{op['pct_of_step']:>8.1f}  {where}")
    return out


# -----------------------------------------------------------------------------
# The suite


def train_rows(table, hp, mesh, inputs, targets, docs, repeats):
    """Compile the train and validation steps cold and warm, time the train step at windows 1 and full
    (synced, then pipelined), read the peak memory, time the validation step."""
    R, T, top = len(inputs), hp.seq_len, tg.window_blocks(hp.num_iterations, hp)
    print("bench: compiling the train and validation steps, cold then warm", file=sys.stderr, flush=True)
    train_step, val_step, params, opt_state, batch_spec, window_spec = build_steps(hp, mesh)
    train, val, compile_s = compile_cold_and_warm(train_step, val_step, params, opt_state, batch_spec, window_spec)
    x, y = (jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in (inputs, targets))
    state, _ = run_train_steps(train, (params, opt_state), x, y, 1, 1)  # warm-up
    synced = {}
    for w in (1, top):
        state, synced[w] = run_train_steps(train, state, x, y, w, repeats)
        table.add(f"train step w={w} (synced)", synced[w], tokens=hp.batch_size, devices=mesh.size,
                  flops=model_flops(hp, docs, w), nominal=nominal_flops(hp, T, w) * R, compiled=train)
    state, pipelined = run_train_steps(train, state, x, y, top, repeats, synced=False)
    table.add(f"train step w={top} (pipelined)", pipelined, tokens=hp.batch_size, devices=mesh.size,
              flops=model_flops(hp, docs, top), nominal=nominal_flops(hp, T, top) * R,
              note="no per-step sync: the device-bound step time")
    memory = memory_report(train)
    val_sec = seconds_per_call(val, (state[0], x, y, np.int32(top)), repeats)
    table.add(f"validation step w={top}", val_sec, tokens=hp.batch_size, devices=mesh.size,
              flops=model_flops(hp, docs, top, backward=False), compiled=val, note="forward, bf16 head")
    summary = {
        "ms_w1": synced[1] * 1e3, "ms_full_window": synced[top] * 1e3, "ms_pipelined": pipelined * 1e3,
        "host_loop_ms": (synced[top] - pipelined) * 1e3, "tokens_per_s": hp.batch_size / synced[top],
        "mfu_nominal": table.rows[f"train step w={top} (synced)"]["mfu_nominal"],
        "estimated_run_s": estimated_run_s(hp, synced[1] * 1e3, synced[top] * 1e3),
        "estimated_run_note": f"{hp.num_iterations} steps, step time linear in the window between w=1 and "
                              f"w={top}; validation excluded, as on the record clock",
    }
    return compile_s, summary, memory, (train, state, x, y)


def guarded(errors: list, section: str, fn, *args):
    """Run one section of the suite; a failure is recorded and printed instead of losing the other sections."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  (reported in the result, the traceback on stderr)
        traceback.print_exc()
        errors.append({"section": section, "error": f"{type(e).__name__}: {e}"[:2000]})
        return None


def run_suite(hp, preset, args):
    """Every measurement of the suite: returns (the JSON-able result, the table of rows)."""
    mesh = tg.make_mesh()
    R, T, top = hp.batch_size // hp.seq_len, hp.seq_len, tg.window_blocks(hp.num_iterations, hp)
    rng = np.random.default_rng(0)
    tokens = sample_tokens(rng, (R, T + 1), hp)
    inputs, targets, docs = tokens[:, :-1], tokens[:, 1:], documents(tokens[:, :-1])
    table, errors = Table(args.peak_tflops), []
    device = jax.devices()[0]
    result = {"device": f"{mesh.size} x {device.device_kind} ({device.platform})", "jax": jax.__version__,
              "preset": preset, "attention": hp.attention, "num_layers": hp.num_layers, "model_dim": hp.model_dim,
              "seq_len": T, "batch_size": hp.batch_size, "sequences_per_device": R // mesh.size,
              "peak_tflops": args.peak_tflops, "windows": [1, top], "attention_implementations": sorted(tg.ATTENTION),
              "errors": errors}
    # the real train step first, so that the device's peak memory is the train step's
    trained = guarded(errors, "train and validation steps", train_rows, table, hp, mesh, inputs, targets, docs,
                      args.repeats)
    result["compile"], result["train_step"], result["memory"], train_state = trained or (None, None, None, None)

    params = tg.init_params(hp, 0)  # the model and its parts run on one device
    guarded(errors, "model", model_rows, table, hp, params, inputs[0], targets[0], docs[0], args.repeats, (1, top),
            (True, False), hp.attention)
    for impl in sorted(set(tg.ATTENTION) - {hp.attention}):
        guarded(errors, f"model with {impl} attention", model_rows, table, hp, params, inputs[0], targets[0], docs[0],
                args.repeats, (top,), (hp.fp8_head,), impl)
    guarded(errors, "embeddings, MLP, head", block_part_rows, table, hp, params, inputs[0], targets[0], rng,
            args.repeats)
    for impl in sorted(tg.ATTENTION):
        guarded(errors, f"{impl} attention kernel", attention_kernel_rows, table, hp, impl, docs[0], rng,
                args.repeats)
        guarded(errors, f"{impl} attention layer", attention_layer_rows, table, hp, impl, params, docs[0], rng,
                args.repeats, sorted({1, *layer_windows(hp, top)}))
    guarded(errors, "optimizer", optimizer_rows, table, hp, mesh, params, rng, args.repeats)
    result["rows"], result["breakdown"], result["profile"] = table.rows, None, None
    if trained:
        result["breakdown"] = guarded(errors, "breakdown", breakdown, hp, table.rows, R // mesh.size, top,
                                      result["train_step"]["ms_pipelined"])
    if trained and args.profile:
        result["profile"] = guarded(errors, "profile", profile_rows, train_state, top, args.profile)
    return result, table


def profile_rows(train_state, window, trace_dir):
    train, state, x, y = train_state
    os.makedirs(trace_dir, exist_ok=True)
    _, sec = profile_train(train, state, x, y, window, trace_dir)
    return top_device_ops(latest_trace(trace_dir), PROFILE_STEPS, sec * 1e3, train.as_text())


def report_lines(result: dict, table: Table) -> list:
    """The suite's printed report: a header per section present, the table, the breakdown, the profile."""
    out = [f"bench suite: preset {result['preset']} ({result['num_layers']} layers, d={result['model_dim']}), "
           f"T={result['seq_len']}, batch {result['batch_size']:,} tokens ({result['sequences_per_device']} "
           f"sequence(s) per device), attention {result['attention']}, {result['device']}, jax {result['jax']}"]
    if result["compile"]:
        c, m, t = result["compile"], result["memory"], result["train_step"]
        peak = "n/a" if m["peak_mib"] is None else f"{m['peak_mib']:,.0f} MiB"
        out += [
            f"compile: train step {c['train_cold_s']:.1f}s cold, {c['train_warm_s']:.1f}s warm; validation step "
            f"{c['val_cold_s']:.1f}s cold, {c['val_warm_s']:.1f}s warm (fresh persistent cache, then "
            f"jax.clear_caches())",
            f"memory: peak {peak} ({m['peak_source']}); compiled train step {m['compiled_peak_mib']:,.0f} MiB "
            f"({m['compiled_source']})",
            f"train step: {t['ms_full_window']:.1f} ms at the full window, {t['ms_w1']:.1f} ms at w=1; host loop "
            f"{t['host_loop_ms']:.1f} ms/step; {t['tokens_per_s']:,.0f} tokens/s; estimated run "
            f"{t['estimated_run_s']:.1f}s ({t['estimated_run_note']})",
        ]
    out += [f"MFU against {result['peak_tflops']:.0f} TFLOP/s per device; GFLOP = useful FLOPs (see bench.py --help)",
            "", *table.lines()]
    if result["breakdown"]:
        out += ["", f"train step (pipelined, w={result['windows'][1]}) from its parts:",
                *(f"  {b['part']:<58}{b['ms']:>10.2f} ms{b['pct_of_step']:>7.1f}%" for b in result["breakdown"])]
    if result["profile"]:
        out += ["", *profile_lines(result["profile"])]
    for e in result["errors"]:
        out.append(f"FAILED {e['section']}: {e['error'].splitlines()[0][:300]}")
    return out


# -----------------------------------------------------------------------------
# Single benchmarks and the command line


def attention_layer_mode(hp, args):
    """Each attention implementation alone at windows 1, 7, 14, then the model forward+backward with each."""
    rng = np.random.default_rng(0)
    tokens = sample_tokens(rng, (hp.seq_len + 1,), hp)
    docs = documents(tokens[:-1])
    table = Table(args.peak_tflops)
    for impl in sorted(tg.ATTENTION):
        attention_kernel_rows(table, hp, impl, docs, rng, args.repeats)
    params = tg.init_params(hp, 0)
    for impl in sorted(tg.ATTENTION):
        model_rows(table, hp, params, tokens[:-1], tokens[1:], docs, args.repeats, (args.window,),
                   (not args.no_fp8,), impl)
    return table


def model_mode(hp, args):
    rng = np.random.default_rng(0)
    tokens = sample_tokens(rng, (hp.seq_len + 1,), hp)
    table = Table(args.peak_tflops)
    model_rows(table, hp, tg.init_params(hp, 0), tokens[:-1], tokens[1:], documents(tokens[:-1]), args.repeats,
               (args.window,), (not args.no_fp8,), hp.attention)
    return table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--suite", action="store_true", help="the whole picture: compile, train step, model, parts")
    mode.add_argument("--attention-layer", action="store_true",
                      help="each attention implementation alone at windows 1, 7, 14, and the model with each")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default: record on a GPU, tiny elsewhere; smoke: the quickest check that the suite runs")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--attention", default="xla", choices=sorted(tg.ATTENTION),
                        help="attention implementation of the model, as in train_gpt.py (default xla)")
    parser.add_argument("--window", type=int, help="long window in blocks for the single benchmarks (default: full)")
    parser.add_argument("--no-fp8", action="store_true", help="single benchmarks: bf16 head instead of FP8")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (median; default 3)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per-device peak for MFU (default 989)")
    parser.add_argument("--profile", metavar="DIR", help="with --suite: trace train steps into DIR, list top ops")
    parser.add_argument("--out", metavar="PATH", help="also write the table and the JSON line to PATH")
    args = parser.parse_args(argv)
    if args.profile and not args.suite:
        parser.error("--profile needs --suite")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    return args


def hyperparameters(args):
    preset = args.preset or ("record" if jax.default_backend() == "gpu" else "tiny")
    changes = {"attention": args.attention}
    if args.seq_len:
        changes["seq_len"] = args.seq_len
    return preset, dataclasses.replace(PRESETS[preset], **changes)


def write_out(path: str, text: str) -> None:
    """Write whole or not at all: a temporary file renamed over the target."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.out:  # fail now, not after the benchmarks
            folder = os.path.dirname(os.path.abspath(args.out))
            os.makedirs(folder, exist_ok=True)
            if os.path.isdir(args.out) or not os.access(folder, os.W_OK):
                raise OSError(f"--out {args.out}: cannot write a file there")
        preset, hp = hyperparameters(args)
        if args.window is None:
            args.window = tg.window_blocks(hp.num_iterations, hp)
        sequences = hp.batch_size // hp.seq_len
        if args.suite and sequences % jax.device_count():
            raise ValueError(f"the step's {sequences} sequences of --seq-len {hp.seq_len} do not split evenly over "
                             f"{jax.device_count()} devices: choose a --seq-len that makes them a multiple")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.suite:
        cache_dir = tempfile.mkdtemp(prefix="bench-compile-cache-")
        tg.enable_compile_cache(cache_dir)  # before anything compiles: JAX reads the setting once
        try:
            result, table = run_suite(hp, preset, args)
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
        lines = report_lines(result, table)
    else:
        table = attention_layer_mode(hp, args) if args.attention_layer else model_mode(hp, args)
        result = {"preset": preset, "seq_len": hp.seq_len, "device": jax.devices()[0].device_kind,
                  "jax": jax.__version__, "rows": table.rows}
        lines = [f"preset {preset}, T={hp.seq_len}, {result['device']}, jax {jax.__version__}", *table.lines()]
    text = "\n".join(lines) + "\n" + json.dumps(result) + "\n"
    print(text, end="")
    if args.out:
        write_out(args.out, text)
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
