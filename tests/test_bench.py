"""bench.py: the analytic FLOP counts against independent references, the profile reader on hand-made
traces, bad input, and the whole suite on CPU at the smoke shape (a subprocess); the profile alone
on the tiny run's program."""
import dataclasses
import gzip
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bench
import train_gpt as tg
from conftest import COMPILE_CACHE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- FLOP counting


def brute_force_pairs(docs, window):
    """The attention rule pair by pair: key at most `window` tokens back, same document."""
    return sum(1 for q in range(len(docs)) for k in range(q + 1) if q - k <= window and docs[q] == docs[k])


@pytest.mark.parametrize("trial", range(4))
def test_attention_pairs_match_a_pair_by_pair_count(trial):
    rng = np.random.default_rng()
    T = int(rng.integers(1, 300))
    docs = np.cumsum(rng.random(T) < rng.choice([0.0, 0.02, 0.2]))
    for window in (0, 1, int(rng.integers(2, 400))):
        assert bench.attention_pairs(docs, window) == brute_force_pairs(docs, window)


def test_model_flops_count_every_matmul_and_each_layers_pairs():
    """The record model's matmul weights from the parameter table, and the attention pairs of each layer
    (paired layers: half the heads over the doubled sequence) from a pair-by-pair count."""
    hp = tg.PRESETS["record"]
    D, V = 768, 50304
    mudd = 4 * 64 * D + (14 + 5 + 26 + 41) * 64  # MUDD and MUDD-gate networks: 2 blocks each, their outputs
    assert bench.matmul_weights(hp) == 10 * 4 * D * D + 11 * 8 * D * D + V * D + mudd
    docs = np.repeat([0, 1, 2], [100, 60, 96])  # 256 tokens, 3 documents
    short, long = 5, 40
    plain = {w: brute_force_pairs(docs, w) for w in (short, long)}
    paired = brute_force_pairs(np.repeat(docs, 2), short)
    layers = (6 * (4 * plain[short] + 2 * plain[long]) + 3 * 4 * paired)  # 4 plain short, 2 long, 4 paired
    assert bench.layer_pairs(docs, short, long) == layers
    assert bench.model_flops(hp, docs[None], short, long) == 6 * bench.matmul_weights(hp) * 256 + 12 * 128 * layers


def test_polar_express_flops_match_xla_cost_analysis():
    hp = bench.PRESETS["smoke"]
    D, K = hp.model_dim, hp.head_dim
    shapes = [(tg.num_qk_matrices(), 2 * K, D), (20, D, D), (22, 4 * D, D)]
    f = jax.jit(lambda *gs: [tg.polar_express(g) for g in gs])
    cost = f.lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # XLA also counts the elementwise work (scaling, the a·X + ... mixes); the matmuls dominate
    assert bench.polar_express_flops(hp) == pytest.approx(cost["flops"], rel=0.1)


def test_estimated_run_takes_each_step_at_its_stage_programs_time():
    hp = tg.PRESETS["cpu"]  # stages at 0, 8, 16, 24 (+3 extension steps sharing stage 2's shape)
    firsts = tg.program_steps(hp)
    assert firsts == [0, 8, 16]
    assert bench.estimated_run_s(hp, {0: 100.0, 8: 200.0, 16: 300.0}) == pytest.approx((8 * 100 + 8 * 200 + 11 * 300) / 1e3)


# ---- the profile reader


def write_trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def meta(pid, tid=None, process=None, thread=None):
    if process:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}


def op(pid, tid, name, ts, dur, hlo_op=None):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur,
            "args": {"hlo_op": hlo_op or name, "hlo_module": "jit_train_step"}}


def test_top_ops_on_cpu_take_thunks_and_subtract_nested_ops(tmp_path):
    """XLA:CPU: host events with an hlo_op; a while loop's own time excludes its body's ops."""
    events = [meta(1, process="/host:CPU"), meta(1, 7, thread="XLAPjRtCpuClient"),
              {"ph": "X", "pid": 1, "tid": 7, "name": "PjitFunction(train_step)", "ts": 0, "dur": 100},
              {"ph": "X", "pid": 1, "tid": 7, "name": "end: while.1", "ts": 90, "dur": 1}]
    for step in range(2):
        t0 = 1000 * step
        events += [op(1, 7, "while.1", t0, 90), op(1, 7, "fusion.2", t0 + 5, 30), op(1, 7, "fusion.2", t0 + 40, 30),
                   op(1, 7, "dot.3", t0 + 95, 4)]
    path = tmp_path / "host.trace.json.gz"
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=2, step_ms=0.2, hlo_text='  %fusion.2 = f32[2]{0} fusion(%p), '
                                   'kind=kLoop, metadata={op_name="jit(train_step)/while/body/dot_general"}')
    rows = {r["op"]: r for r in profile["top_ops"]}
    assert list(rows) == ["fusion.2", "while.1", "dot.3"]
    assert rows["fusion.2"]["count"] == 2 and rows["fusion.2"]["ms"] == pytest.approx(0.060)
    assert rows["while.1"]["ms"] == pytest.approx(0.030)  # 90 - 2 x 30 nested
    assert rows["fusion.2"]["pct_of_step"] == pytest.approx(30.0)
    assert rows["fusion.2"]["jax_op"] == "jit(train_step)/while/body/dot_general"
    assert profile["device_busy_ms"] == pytest.approx(0.094)


def test_ops_running_at_once_share_the_time_and_none_is_lost(tmp_path):
    """Kernels whose spans overlap in part (concurrent kernels on the trace's one 'XLA Ops' line): a chain
    0-10, 5-15, 12-20 us keeps the device busy 20 us, shared where two run (nesting them, as the profile
    did before, left 10 us of 20 and no gap to explain the rest). Two devices: figures per device."""
    events = [meta(2, process="/device:GPU:0"), meta(2, 1, thread="XLA Ops"),
              op(2, 1, "fusion.1", 0, 10), op(2, 1, "fusion.2", 5, 10), op(2, 1, "fusion.3", 12, 8)]
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=1, step_ms=0.025)
    assert {r["op"]: r["ms"] for r in profile["top_ops"]} == {
        "fusion.1": pytest.approx(0.0075), "fusion.2": pytest.approx(0.006), "fusion.3": pytest.approx(0.0065)}
    assert profile["device_busy_ms"] == pytest.approx(0.020) and profile["device_busy_pct"] == pytest.approx(80.0)
    assert profile["idle"]["ms_per_step"] == 0 and profile["idle"]["outside_ms_per_step"] == pytest.approx(0.005)

    # a second device runs the same 7 us later, then idles 13 us before one more op (40-45 us): figures are
    # each device's own (its gaps, its first op .. last), averaged over the devices
    twice = events + [meta(3, process="/device:GPU:1"), meta(3, 1, thread="XLA Ops")] + [
        {**e, "pid": 3, "ts": e["ts"] + 7} for e in events if e["ph"] == "X"] + [op(3, 1, "fusion.4", 40, 5)]
    write_trace(path, twice)
    both = bench.top_device_ops(str(path), steps=1, step_ms=0.05)
    assert [(r["op"], r["count"], r["ms"]) for r in both["top_ops"]] == [
        (r["op"], r["count"], pytest.approx(r["ms"])) for r in profile["top_ops"]] + [("fusion.4", 0.5, 0.0025)]
    assert both["device_busy_ms"] == pytest.approx(0.0225) and both["idle"]["ops_per_step"] == 3.5
    assert both["idle"]["ms_per_step"] == pytest.approx(0.0065) and [g["us"] for g in both["idle"]["longest"]] == [13]
    assert both["idle"]["outside_ms_per_step"] == pytest.approx((0.050 - 0.020 + 0.050 - 0.038) / 2)


def test_exclusive_times_match_a_microsecond_grid(tmp_path):
    """Random ops on three lines, nested and overlapping in part: each op's exclusive time against a
    microsecond grid (each microsecond shared by the running ops that hold no other running op), their
    sum the device's busy time, and busy + idle + outside the first .. last op = the step."""
    rng = np.random.default_rng()
    spans = set()
    while len(spans) < 80:
        ts, dur = int(rng.integers(0, 5_000)), int(rng.integers(1, 300))
        spans.add((ts, dur))
        if rng.random() < 0.3:  # an op inside it (distinct spans: which of two equal spans holds the other is a convention)
            spans.add((ts + int(rng.integers(0, dur)), max(1, int(rng.integers(0, dur)) // 2)))
    spans = sorted(spans)
    events = [meta(2, process="/device:GPU:0")] + [meta(2, t, thread=f"Stream #{t}") for t in (1, 2, 3)]
    events += [op(2, int(rng.integers(1, 4)), f"fusion.{i}", ts, dur) for i, (ts, dur) in enumerate(spans)]
    start, end = min(ts for ts, _ in spans), max(ts + dur for ts, dur in spans)
    expected, busy = np.zeros(len(spans)), 0
    holds = lambda i, j: spans[i][0] <= spans[j][0] and sum(spans[j]) <= sum(spans[i]) and i != j  # noqa: E731
    for us in range(start, end):
        running = [i for i, (ts, dur) in enumerate(spans) if ts <= us < ts + dur]
        innermost = [i for i in running if not any(holds(i, j) for j in running)]
        for i in innermost:
            expected[i] += 1 / len(innermost)
        busy += bool(running)
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    step_ms = (end - start) / 1e3 + 0.5
    profile = bench.top_device_ops(str(path), steps=1, step_ms=step_ms, k=len(spans))
    assert {r["op"]: r["ms"] for r in profile["top_ops"]} == {
        f"fusion.{i}": pytest.approx(us / 1e3, abs=1e-12) for i, us in enumerate(expected)}
    assert profile["device_busy_ms"] == pytest.approx(busy / 1e3)
    idle = profile["idle"]
    assert profile["device_busy_ms"] + idle["ms_per_step"] + idle["outside_ms_per_step"] == pytest.approx(step_ms)
    assert idle["outside_ms_per_step"] == pytest.approx(0.5)


def test_top_ops_on_a_gpu_read_device_lines_only(tmp_path):
    """Device processes only (not the host's launch events), without the derived 'XLA Modules' line."""
    events = [meta(1, process="/host:CPU"), meta(2, process="/device:GPU:0"), meta(2, 1, thread="Stream #7(Compute)"),
              meta(2, 2, thread="XLA Modules"),
              op(1, 9, "fusion.5", 0, 500),  # host-side launch of the same op: not device time
              op(2, 2, "jit_train_step", 0, 300),
              op(2, 1, "sm90_gemm_kernel", 10, 120, hlo_op="custom-call.4"),
              op(2, 1, "loop_fusion", 140, 50, hlo_op="fusion.5")]
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=1, step_ms=0.25)
    assert [(r["op"], r["kernel"], r["ms"]) for r in profile["top_ops"]] == [
        ("custom-call.4", "sm90_gemm_kernel", pytest.approx(0.12)), ("fusion.5", "loop_fusion", pytest.approx(0.05))]
    assert profile["device_busy_pct"] == pytest.approx(68.0)


# Frames as XLA's compiled text lists them: loss:30 calls mlp:12 (two ops) and norm:7 (one op).
FRAMES = """
FileNames
1 "train_gpt.py"

FunctionNames
1 "loss"
2 "mlp"
3 "norm"

FileLocations
1 {file_name_id=1 function_name_id=1 line=30 end_line=30 column=1 end_column=9}
2 {file_name_id=1 function_name_id=2 line=12 end_line=12 column=1 end_column=9}
3 {file_name_id=1 function_name_id=3 line=7 end_line=7 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}
"""


def test_device_time_is_summed_by_source_line(tmp_path):
    """Every op's exclusive time under its instruction's innermost two frames, ranked; ops without a frame
    under '?'; the lines' times add up to the device's busy time."""
    hlo = "\n".join(f'  %{name} = f32[2]{{0}} fusion(%p), kind=kLoop, metadata={{op_name="x" stack_frame_id={frame}}}'
                    for name, frame in (("fusion.1", 2), ("gemm.2", 2), ("fusion.3", 3))) + "\n" + FRAMES
    events = [meta(2, process="/device:GPU:0"), meta(2, 1, thread="XLA Ops")]
    for step in range(2):
        t0 = 1000 * step
        events += [op(2, 1, "fusion.1", t0, 40), op(2, 1, "gemm.2", t0 + 50, 100), op(2, 1, "fusion.3", t0 + 200, 70),
                   op(2, 1, "copy.4", t0 + 300, 10)]
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=2, step_ms=0.4, hlo_text=hlo)
    assert [(r["source"], r["count"]) for r in profile["top_sources"]] == [
        ("mlp:12 < loss:30", 2), ("norm:7 < loss:30", 1), ("?", 1)]
    assert [r["ms"] for r in profile["top_sources"]] == pytest.approx([0.14, 0.07, 0.01])
    assert profile["top_sources"][0]["pct_of_step"] == pytest.approx(35.0)
    assert sum(r["ms"] for r in profile["top_sources"]) == pytest.approx(profile["device_busy_ms"])
    assert "mlp:12 < loss:30" in "\n".join(bench.profile_lines({**profile, "trace": str(path)}))


def test_kernels_inside_a_command_buffer_count_under_their_fusions(tmp_path):
    """In a command buffer every event's hlo_op is the buffer's: the kernel's name (its fusion's, with
    '_' for '.' and '-') finds the fusion, its jax op and its line; a kernel of no instruction (a memcpy,
    a cuBLAS GEMM) is a row of its own, by its name, under no line."""
    hlo = ('  %loop-fusion.7 = f32[2]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/mul" stack_frame_id=3}\n'
           '  %input_reduce_fusion.56 = f32[2]{0} fusion(%p), kind=kInput, metadata={op_name="jit(f)/dot_general" '
           'stack_frame_id=2}\n  %command_buffer.3 = (f32[2]{0}) call(%p), to_apply=%cb\n' + FRAMES)
    events = [meta(2, process="/device:GPU:0"), meta(2, 1, thread="XLA Ops"),
              op(2, 1, "input_reduce_fusion_56", 0, 60, hlo_op="command_buffer_3"),
              op(2, 1, "loop_fusion_7", 70, 20, hlo_op="command_buffer_3"),
              op(2, 1, "memcpy128", 100, 5, hlo_op="command_buffer_3"),
              op(2, 1, "input_reduce_fusion_56", 110, 40, hlo_op="command_buffer_3")]
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=1, step_ms=0.2, hlo_text=hlo)
    assert [(r["op"], r["jax_op"], r["count"]) for r in profile["top_ops"]] == [
        ("input_reduce_fusion.56", "jit(f)/dot_general", 2), ("loop-fusion.7", "jit(f)/mul", 1),
        ("memcpy128", None, 1)]
    assert [(r["source"], r["ms"]) for r in profile["top_sources"]] == [
        ("mlp:12 < loss:30", pytest.approx(0.1)), ("norm:7 < loss:30", pytest.approx(0.02)), ("?", pytest.approx(0.005))]


def test_cublas_kernels_inside_a_command_buffer_are_placed_at_their_calls_by_position(tmp_path):
    """cuBLAS's kernels in a command buffer name no instruction: between two named kernels of one
    computation they ran its cuBLAS calls between those two in the schedule, in order, where the numbers
    agree (a dynamic-slice fusion's call at the fusion's place); two kernels for one call, kernels between
    computations, or before any named kernel stay rows of their own names under '?'. A memcpy between
    does not count; the trace's events come in any order."""
    cublas = ('  %{name} = (bf16[2]{{0}}, s8[8]{{0}}) custom-call(%p), custom_call_target="__cublas$lt$matmul{f8}", '
              'metadata={{op_name="jit(f)/{jax}" stack_frame_id={frame}}}\n')
    fusion = '  %{name} = f32[2]{{0}} fusion(%p), kind=kLoop, calls=%fused, metadata={{op_name="jit(f)/mul" stack_frame_id=3}}\n'
    hlo = ("HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[2]{0})->f32[2]{0}}\n\n"
           "%fused (param_0: f32[2]) -> f32[2] {\n  %param_0 = f32[2]{0} parameter(0)\n"
           "  ROOT %negate.1 = f32[2]{0} negate(%param_0)\n}\n\n"
           "%sliced_gemm (q: f32[2]) -> (bf16[2], s8[8]) {\n  %q = f32[2]{0} parameter(0)\n"
           + cublas.format(name="custom-call.11", f8="", jax="dot_general", frame=2).replace("  %", "  ROOT %", 1) + "}\n\n"
           "%body (p: f32[2]) -> f32[2] {\n  %p = f32[2]{0} parameter(0)\n" + fusion.format(name="loop_fusion.1")
           + cublas.format(name="custom-call.2", f8="", jax="dot_general", frame=2)
           + "  %get-tuple-element.3 = bf16[2]{0} get-tuple-element(%custom-call.2), index=0\n"
           + cublas.format(name="custom-call.4", f8="$f8", jax="head_dot", frame=1) + fusion.format(name="loop_fusion.5")
           + cublas.format(name="custom-call.6", f8="", jax="dot_general", frame=2) + fusion.format(name="loop_fusion.7")
           + "  %dynamic-slice-fusion.10 = (bf16[2]{0}, s8[8]{0}) fusion(%p), kind=kCustom, calls=%sliced_gemm\n"
           + fusion.format(name="loop_fusion.12") + "}\n\nENTRY %main (a: f32[2]) -> f32[2] {\n  %a = f32[2]{0} parameter(0)\n"
           + cublas.format(name="custom-call.8", f8="", jax="dot_general", frame=2) + fusion.format(name="input_fusion.9")
           + "}\n" + FRAMES)
    runs = [("nvjet_sm90_lone", 0), ("loop_fusion_1", 1), ("nvjet_sm90_tss_a", 10), ("memcpy32_post", 1),
            ("nvjet_sm90_qqsss_b", 20), ("loop_fusion_5", 1), ("nvjet_sm90_tss_c", 30), ("loop_fusion_7", 1),
            ("nvjet_sm90_sliced", 8), ("loop_fusion_12", 1), ("loop_fusion_5", 1), ("nvjet_sm90_two", 5), ("nvjet_sm90_two", 6), ("loop_fusion_7", 1),
            ("nvjet_sm90_across", 7), ("input_fusion_9", 1)]
    events, t = [meta(2, process="/device:GPU:0"), meta(2, 1, thread="XLA Ops")], 0
    for name, dur in runs:
        events.append(op(2, 1, name, t, dur or 2, hlo_op="command_buffer_3"))
        t += 100
    order = np.random.default_rng().permutation(len(events) - 2)
    events = events[:2] + [events[2 + i] for i in order]
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=1, step_ms=2.0, hlo_text=hlo, k=20)
    rows = {r["op"]: (r["kernel"], r["jax_op"], r["ms"]) for r in profile["top_ops"]}
    assert rows["custom-call.2"] == ("nvjet_sm90_tss_a", "jit(f)/dot_general", pytest.approx(0.010))
    assert rows["custom-call.4"] == ("nvjet_sm90_qqsss_b", "jit(f)/head_dot", pytest.approx(0.020))
    assert rows["custom-call.6"] == ("nvjet_sm90_tss_c", "jit(f)/dot_general", pytest.approx(0.030))
    assert rows["custom-call.11"] == ("nvjet_sm90_sliced", "jit(f)/dot_general", pytest.approx(0.008))
    assert "custom-call.8" not in rows
    for unplaced, ms in (("nvjet_sm90_lone", 0.002), ("nvjet_sm90_two", 0.011), ("nvjet_sm90_across", 0.007),
                         ("memcpy32_post", 0.001)):
        assert rows[unplaced] == (None, None, pytest.approx(ms))
    sources = {r["source"]: r["ms"] for r in profile["top_sources"]}
    assert sources == {"mlp:12 < loss:30": pytest.approx(0.048), "loss:30": pytest.approx(0.020),
                       "norm:7 < loss:30": pytest.approx(0.007), "?": pytest.approx(0.021)}
    assert profile["library_gemms"] == {"kernels": 8, "placed": 4, "ms": pytest.approx(0.088),
                                        "placed_ms": pytest.approx(0.068)}
    assert "placed at their cuBLAS calls by their position between named kernels (gemms_by_position) 4, 0.1 ms" in \
        "\n".join(bench.profile_lines(profile))


def test_pallas_kernels_and_renamed_kernels_inside_a_command_buffer_are_named(tmp_path):
    """A Pallas kernel (a Triton custom call) is named after the call's `name`, a second kernel of a name
    gets '__N': each such kernel is a row under the lines of every call of its name (the name is the
    backend config's, not one escaped in the kernel's IR); a fusion's second kernel ('__N') counts under the fusion."""
    triton = ('  %{call} = bf16[8]{{0}} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name='
              '"jit(f)/attention_fwd/pallas_call" stack_frame_id={frame}}}, backend_config={{ir = "ML\\EFR, name = '
              '\\22x\\22", name = "attention_fwd", num_stages = 2 : i32, num_warps = 8 : i32}}\n')
    hlo = ('  %loop-fusion.7 = f32[2]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(f)/mul" stack_frame_id=3}\n'
           + triton.format(call="pallas_call.4", frame=2) + triton.format(call="pallas_call.5", frame=3) + FRAMES)
    events = [meta(2, process="/device:GPU:0"), meta(2, 1, thread="XLA Ops"),
              op(2, 1, "attention_fwd", 0, 50, hlo_op="command_buffer_3"),
              op(2, 1, "attention_fwd__1", 60, 30, hlo_op="command_buffer_3"),
              op(2, 1, "loop_fusion_7__1", 100, 10, hlo_op="command_buffer_3"),
              op(2, 1, "attention_fwd", 120, 20, hlo_op="pallas_call.5")]  # outside a buffer: its own call
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=1, step_ms=0.2, hlo_text=hlo)
    assert [(r["op"], r["jax_op"], r["ms"]) for r in profile["top_ops"]] == [
        ("attention_fwd", "jit(f)/attention_fwd/pallas_call", pytest.approx(0.05)),
        ("attention_fwd__1", "jit(f)/attention_fwd/pallas_call", pytest.approx(0.03)),
        ("pallas_call.5", "jit(f)/attention_fwd/pallas_call", pytest.approx(0.02)),
        ("loop-fusion.7", "jit(f)/mul", pytest.approx(0.01))]
    assert [(r["source"], r["ms"]) for r in profile["top_sources"]] == [
        ("mlp:12 < loss:30 | norm:7 < loss:30", pytest.approx(0.08)), ("norm:7 < loss:30", pytest.approx(0.03))]


def test_idle_time_is_the_time_no_device_op_runs_with_the_longest_gaps_named(tmp_path):
    """Random ops on two streams, some nested (a loop and its body): the idle time and its gaps against a
    microsecond grid; the longest gap's neighbours by their op and source line."""
    rng = np.random.default_rng()
    events = [meta(2, process="/device:GPU:0"), meta(2, 1, thread="Stream #1"), meta(2, 2, thread="Stream #2")]
    for _ in range(60):
        ts, dur = int(rng.integers(0, 20_000)), int(rng.integers(1, 400))
        events.append(op(2, int(rng.integers(1, 3)), f"fusion.{rng.integers(5)}", ts, dur))
        if rng.random() < 0.3:  # an op nested inside it
            events.append(op(2, events[-1]["tid"], "fusion.9", ts + dur // 4, dur // 2 or 1))
    ops = [e for e in events if e["ph"] == "X"]
    start, end = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
    busy = np.zeros(end - start, bool)
    for e in ops:
        busy[e["ts"] - start:e["ts"] + e["dur"] - start] = True
    runs = [len(r) for r in "".join("." if b else "x" for b in busy).split(".") if r]  # idle runs, in us
    path = tmp_path / "gpu.trace.json.gz"
    write_trace(path, events)
    idle = bench.top_device_ops(str(path), steps=2, step_ms=20.0)["idle"]
    assert idle["ms_per_step"] == pytest.approx((~busy).sum() / 1e3 / 2)
    assert sum(b["count"] for b in idle["by_size"]) * 2 == pytest.approx(len(runs))
    assert sum(b["ms"] for b in idle["by_size"]) == pytest.approx(idle["ms_per_step"])
    assert [g["us"] for g in idle["longest"]] == sorted(runs, reverse=True)[:bench.TOP_GAPS]
    assert idle["ops_per_step"] == pytest.approx(len(ops) / 2)

    hlo = "\n".join(f'  %{name} = f32[2]{{0}} fusion(%p), kind=kLoop, metadata={{op_name="x" stack_frame_id={frame}}}'
                    for name, frame in (("fusion.1", 2), ("fusion.3", 3))) + "\n" + FRAMES
    events = [meta(2, process="/device:GPU:0"), meta(2, 1, thread="XLA Ops"), op(2, 1, "while.2", 0, 100),
              op(2, 1, "fusion.1", 10, 20), op(2, 1, "fusion.3", 2_100, 10), op(2, 1, "fusion.1", 2_115, 5)]
    write_trace(path, events)
    profile = bench.top_device_ops(str(path), steps=1, step_ms=2.2, hlo_text=hlo)
    assert [(g["us"], g["after"], g["before"]) for g in profile["idle"]["longest"]] == [
        (2_000, "while.2 (?)", "fusion.3 (norm:7 < loss:30)"), (5, "fusion.3 (norm:7 < loss:30)",
                                                                 "fusion.1 (mlp:12 < loss:30)")]
    assert [b["count"] for b in profile["idle"]["by_size"]] == [1, 0, 0, 1]
    assert "idle 2.00 ms after while.2 (?), before fusion.3 (norm:7 < loss:30)" in "\n".join(
        bench.profile_lines({**profile, "trace": str(path)}))


def test_a_missing_trace_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace.json.gz"):
        bench.latest_trace(str(tmp_path))


def test_a_failing_section_is_recorded_and_the_rest_goes_on(capsys):
    errors = []
    assert bench.guarded(errors, "optimizer", lambda: 1 / 0) is None
    assert bench.guarded(errors, "model", lambda x: x + 1, 1) == 2
    assert errors == [{"section": "optimizer", "error": "ZeroDivisionError: division by zero"}]
    assert "ZeroDivisionError" in capsys.readouterr().err  # the traceback


# ---- bad input


def test_bad_flags_exit_2_with_a_reason(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--profile", "somewhere", "--sweep", "fwd:128/8/2"])
    assert e.value.code == 2 and "--profile goes with --suite or alone" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--repeats", "0"])
    assert e.value.code == 2 and "--repeats 0" in capsys.readouterr().err
    for flags in (["--sweep", "fwd:128/8/2"], []):
        with pytest.raises(SystemExit) as e:
            bench.parse_args([*flags, "--compile-cache-dir", str(tmp_path)])
        assert e.value.code == 2 and "--compile-cache-dir goes with --profile or --suite" in capsys.readouterr().err
    assert bench.main(["--out", str(tmp_path)]) == 2  # a folder: refused before any benchmark runs
    assert "cannot write" in capsys.readouterr().err
    for flags in (["--suite", "--profile", "somewhere"], []):
        with pytest.raises(SystemExit) as e:
            bench.parse_args([*flags, "--stage", "1"])
        assert e.value.code == 2 and "--stage goes with --profile alone" in capsys.readouterr().err
    assert bench.main(["--preset", "smoke", "--profile", str(tmp_path / "t"), "--stage", "4"]) == 2
    assert "--stage 4: preset smoke has stages 0 to 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--suite", "--skip", "model,train"])
    assert e.value.code == 2 and ("--skip train: the sections that can be left out are model, parts"
                                  in capsys.readouterr().err)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--skip", "model"])
    assert e.value.code == 2 and "--skip goes with --suite" in capsys.readouterr().err
    assert bench.parse_args(["--suite", "--skip", "parts,model"]).skip == ["parts", "model"]


def test_the_sweep_times_each_configuration_and_refuses_bad_items(tmp_path, capsys):
    out = tmp_path / "sweep.txt"
    assert bench.main(["--preset", "smoke", "--sweep", "fwd:128/8/2,dq:64/4/2,up:128x256x128/8/3,dpre:64x64x32/4/2,"
                       "dc:16/8/1", "--repeats", "1", "--rounds", "2", "--out", str(out)]) == 0
    table, line = out.read_text().rstrip("\n").rsplit("\n", 1)
    result = json.loads(line)
    hp = bench.PRESETS["smoke"]
    windows = sorted({int(w) for w in tg.windows(tg.stage_bounds(hp)[-2][0], hp)})
    assert set(result["rows"]) == {f"pallas {k} W={w}" for k in ("fwd:128/8/2", "dq:64/4/2") for w in windows} | {
        "pallas up:128x256x128/8/3", "pallas dpre:64x64x32/4/2", "pallas dc:16/8/1"}  # 128 tokens, d 96
    assert result["errors"] == [] and all(row["ms"] > 0 and row["gflop"] > 0 for row in result["rows"].values())
    assert result["rows"]["pallas up:128x256x128/8/3"]["gflop"] == 2 * 128 * 96 * 384 / 1e9
    # every row timed once in each of the 2 rounds (after everything compiled): its ms the rounds' median
    assert set(result["rounds_ms"]) == set(result["rows"]) and "median of 2 rounds of 1 calls" in table
    for name, row in result["rows"].items():
        ms = result["rounds_ms"][name]
        assert len(ms) == 2 and row["ms"] == pytest.approx(np.median(ms))
        assert row["note"].endswith(f"; rounds {ms[0]:.2f}, {ms[1]:.2f} ms") and row["note"] in table
    for bad in ("fwd:100/8/2", "fwd:128/8", "attn:64/4/2", "dq:64/0/2", "up:128x256/8/3", "dpre:128x96x64/8/3",
                "up:8x16x16/4/2", "head:128x128x128/8/3", "dc:32/4/1"):  # the head has no GEMM kernel of ours
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--sweep", bad])
        assert e.value.code == 2 and f"--sweep item {bad!r}" in capsys.readouterr().err
    for argv, says in ((["--sweep", "fwd:64/8/2,dq:64/8/2,fwd:64/8/2"], "--sweep item 'fwd:64/8/2' is listed twice"),
                       (["--sweep", "fwd:64/8/2", "--rounds", "0"], "--rounds 0: must be at least 1"),
                       (["--suite", "--rounds", "2"], "--rounds goes with --sweep")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv


def test_the_sweep_compiles_everything_then_times_round_after_round(monkeypatch, capsys):
    """Every configuration compiles before the first timing; each round times every row once, with a
    warm-up call in the first round only; a row that fails in a later round is reported and left out,
    the others go on. The compiles are real; the timing is a stand-in that records its calls."""
    events, calls = [], {}
    real_compile = bench.compile_timed
    monkeypatch.setattr(bench, "compile_timed", lambda *a: events.append("compile") or real_compile(*a))

    def timed(compiled, args, repeats, warm_up=True):
        row = (id(compiled), str(args[-1]))  # a row: its program and its last argument (an attention window)
        calls[row] = calls.get(row, 0) + 1
        events.append((row, warm_up))
        if row == next(iter(calls)) and calls[row] == 2:  # the first row fails in round 2
            raise RuntimeError("planted failure in round 2")
        return 1e-3

    monkeypatch.setattr(bench, "seconds_per_call", timed)
    table = bench.Table(989.0)
    configs = bench.parse_sweep("fwd:64/8/2,up:128x256x128/8/3,dc:16/4/1")
    errors, rounds = bench.sweep_rows(table, bench.PRESETS["smoke"], configs, repeats=1, rounds=3)
    assert events[:3] == ["compile"] * 3 and "compile" not in events[3:]
    timings, rows = events[3:], 4  # fwd at the smoke preset's 2 windows, up, dc
    assert len(timings) == 3 * rows - 1  # the failed row timed twice, the others in all 3 rounds
    assert [w for _, w in timings[:rows]] == [True] * rows and not any(w for _, w in timings[rows:])
    assert [r for r, _ in timings[:rows]] == [r for r, _ in timings[rows:2 * rows]]  # round after round
    assert len(errors) == 1 and "planted failure in round 2" in errors[0]["error"]
    assert len(table.rows) == len(rounds) == rows - 1 and all(len(ms) == 3 for ms in rounds.values())
    assert "round 3: 1.00 ms" in capsys.readouterr().err  # progress as each measurement ends


def test_the_model_rows_run_the_presets_dc_mlp_and_head_kernels(monkeypatch):
    """bench.py --dc/--mlp/--head reach the model's rows: sequence_loss (a stand-in here, cheap to compile;
    called as the real one can be) gets hp's choices, and the rows say them. (The real model's rows:
    plain `bench.py`; the suite's test leaves them out.)"""
    seen, real = [], inspect.signature(tg.sequence_loss)

    def stand_in(*args, **kwargs):
        bound = real.bind(*args, **kwargs).arguments
        seen.append((bound["attention_impl"], bound["dc_impl"], bound["mlp_impl"], bound["head_impl"]))
        return sum(jnp.sum(v.astype(jnp.float32)) for v in jax.tree.leaves(bound["p"])), None, None

    monkeypatch.setattr(tg, "sequence_loss", stand_in)
    hp = dataclasses.replace(bench.PRESETS["smoke"], dc="pallas", mlp="pallas", head="pallas")
    inputs, targets = bench.sample_chunks(np.random.default_rng(0), hp, 1, hp.stages[-1].batch_size // tg.RANKS)
    table = bench.Table(989.0)
    bench.model_rows(table, hp, tg.init_params(hp, 0), inputs, targets, 1)
    assert seen and set(seen) == {("xla", "pallas", "pallas", "pallas")}
    assert list(table.rows) and all(name.startswith("model fwd+bwd xla dc pallas mlp pallas head pallas stage ")
                                    for name in table.rows)


def test_the_gpu_sessions_default_sweep_is_valid_sweep_syntax():
    """tests/gpu/session.sh's SWEEP_DEFAULT (assigned, then extended with +=) parses, and names every kernel:
    a typo there would cost a GPU session's minutes."""
    text = open(os.path.join(ROOT, "tests", "gpu", "session.sh")).read()
    items = ",".join(v.lstrip(",") for v in re.findall(r"^SWEEP_DEFAULT\+?=(\S+)$", text, re.M))
    kernels = {kernel for kernel, _ in bench.parse_sweep(items)}
    assert kernels == set(bench.ATTENTION_KERNELS) | set(bench.GEMM_KERNELS) | set(bench.DC_KERNELS)


# ---- the suite on CPU


ROW_FIELDS = {"ms", "tokens_per_s", "gflop", "tflops", "mfu", "mfu_nominal", "xla_gflop", "xla_loop", "compile_s",
              "note"}


def test_the_profile_alone_loads_a_stages_program_and_ranks_its_ops_and_lines(tiny_attempt, tmp_path):
    """At --preset smoke the program is the tests' tiny run's: the shared attempt's train_gpt.py compiled
    it into the test run's compile cache (conftest), so this bench.py loads it from there instead of
    compiling it (a minute of CPU), as a GPU session's profile loads its short run's (tests/gpu/session.sh).
    One program serves every stage there: --stage 2 asks for it with stage 2's inputs."""
    out = tmp_path / "profile.txt"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--preset", "smoke", "--profile",
                           str(tmp_path / "trace"), "--stage", "2", "--compile-cache-dir", COMPILE_CACHE,
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout
    assert out.read_text() == printed
    table, line = printed.rstrip("\n").rsplit("\n", 1)
    result = json.loads(line)
    assert tg.program_steps(bench.PRESETS["smoke"]) == [0]  # one program serves every stage: stage 0's
    assert table.startswith("profile: preset smoke, stage 2's train program (chunks of 128, 1 MTP weights, attention "
                            "xla, dc xla, mlp xla, head xla) loaded from the persistent compile cache in ")  # smoke: TINY_FLAGS
    assert result["loaded_from_cache"] and result["compile_s"] > 0 and (result["stage"], result["chunk"]) == (2, 128)
    profile = result["profile"]
    assert profile["steps"] == bench.PROFILE_STEPS and profile["trace"].startswith(str(tmp_path / "trace"))
    assert 0 < len(profile["top_ops"]) <= bench.TOP_OPS and 0 < len(profile["top_sources"]) <= bench.TOP_SOURCES
    for op in profile["top_ops"]:
        assert op["ms"] > 0 and op["count"] > 0 and 0 < op["pct_of_step"] <= 100, op
    assert any(op["jax_op"] for op in profile["top_ops"]) and profile["top_ops"][0]["op"] in table
    ms = [r["ms"] for r in profile["top_sources"]]
    assert ms == sorted(ms, reverse=True) and ms[-1] > 0
    assert sum(ms) <= profile["device_busy_ms"] * (1 + 1e-9)
    named = [r["source"] for r in profile["top_sources"] if r["source"] != "?"]
    assert any(re.match(r"(gpt_hidden|attention|sequence_loss|device_step\S*):\d+ < ", s) for s in named), named
    assert all(r["source"] in table for r in profile["top_sources"])
    idle = profile["idle"]  # (XLA:CPU's thunks run one after another: the gaps are the host's own work)
    assert idle["ops_per_step"] > 0 and 0 <= idle["ms_per_step"] < profile["step_ms"]
    assert "the device idle between ops" in table and len(idle["longest"]) <= bench.TOP_GAPS


def test_the_suites_first_compile_is_cold_in_a_fresh_cache_unless_it_is_given_one(monkeypatch, tmp_path, capsys):
    """Without --compile-cache-dir: a fresh cache, removed afterwards, and the first compile called cold;
    with it: that cache, kept, and what the first compile loaded from it. (The suite: a stand-in.)"""
    caches = []
    monkeypatch.setattr(tg, "enable_compile_cache", caches.append)  # (this process's own cache stays)

    def suite(hp, preset, args, cache):
        assert os.path.isdir(caches[-1])
        result = {"preset": preset, "model_dim": hp.model_dim, "vocab": hp.padded_vocab, "chunks_per_device": 8,
                  "stages": [dataclasses.asdict(s) for s in hp.stages], "attention": "xla", "dc": "xla", "mlp": "xla",
                  "head": "xla", "device": "1 x cpu", "jax": jax.__version__, "peak_tflops": 989.0, "errors": [],
                  "profile": None, "skipped": [], "train_step": {"ms_by_stage": {"0": 5.0}, "host_loop_ms": 1.0,
                                                  "tokens_per_s_last_stage": 9.0, "estimated_run_s": 2.0,
                                                  "estimated_run_note": "n"},
                  "memory": {"peak_mib": None, "peak_source": "n/a", "compiled_peak_mib": 1.0, "compiled_source": "x"},
                  "compile": {"cache": cache, "first_s": 38.04, "first_loaded": 0 if cache is None else 2,
                              "again_s": 6.81, "again_loaded": 2, "programs": 2}}
        return result, bench.Table(989.0)

    monkeypatch.setattr(bench, "run_suite", suite)
    assert bench.main(["--suite", "--preset", "smoke"]) == 0
    assert caches[0].startswith(tempfile.gettempdir()) and not os.path.exists(caches[0])  # fresh, then removed
    assert ("compile: the train programs and the validation step 38.0s cold (a fresh persistent cache), 6.8s warm "
            "(the same cache after jax.clear_caches(): 2 of 2 programs loaded from it)") in capsys.readouterr().out
    mine = tmp_path / "cache"
    mine.mkdir()
    (mine / "entry").write_text("kept")
    assert bench.main(["--suite", "--preset", "smoke", "--compile-cache-dir", str(mine)]) == 0
    assert caches[1] == str(mine) and (mine / "entry").read_text() == "kept"
    assert (f"38.0s with the persistent cache {mine} (2 of 2 programs loaded from it), 6.8s warm"
            in capsys.readouterr().out)


@pytest.mark.heavy(6)
def test_the_suite_runs_on_cpu_and_reports_every_field(request, tmp_path):
    """At --preset smoke with the test run's compile cache, where the shared attempt's train_gpt.py
    compiled the tiny run's programs: the suite's train and validation programs are those (it loads
    both), and its compile section says so. (A fresh cache's report: the test above.) The model's rows
    left out (--skip model: their own compile, ~40 s of CPU; their code: the stand-in test above)."""
    request.getfixturevalue("tiny_attempt")  # the heavy tests' order has it made by now (conftest)
    out = tmp_path / "results" / "suite.txt"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--suite", "--preset", "smoke",
                           "--repeats", "1", "--compile-cache-dir", COMPILE_CACHE, "--skip", "model",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)  # (the profile: the test above)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text() == proc.stdout  # the table and the JSON line, both
    table, line = proc.stdout.rstrip("\n").rsplit("\n", 1)
    result = json.loads(line)
    assert result["errors"] == [] and "FAILED" not in table
    hp = bench.PRESETS["smoke"]
    assert result["preset"] == "smoke" and result["chunks_per_device"] == 8
    c = result["compile"]
    assert set(c) == {"cache", "first_s", "first_loaded", "again_s", "again_loaded", "programs"}
    assert c["cache"] == COMPILE_CACHE and c["first_s"] > 0
    assert c["programs"] == c["first_loaded"] == 2  # one train program, the validation step
    assert c["again_s"] is None and c["again_loaded"] is None  # all loaded: that was the warm compile
    assert (f"compile: the train programs and the validation step {c['first_s']:.1f}s with the persistent cache "
            f"{COMPILE_CACHE} (2 of 2 programs loaded from it), so that was the warm compile (no second one)") in table
    assert result["memory"]["peak_mib"] is None and "n/a" in result["memory"]["peak_source"]
    assert result["memory"]["compiled_peak_mib"] > 0
    t = result["train_step"]
    assert list(t["ms_by_stage"]) == ["0"] and t["ms_by_stage"]["0"] > 0  # smoke: one program serves every stage
    assert t["estimated_run_s"] > 0 and t["ms_pipelined_last_stage"] > 0 and t["tokens_per_s_last_stage"] > 0

    rows = result["rows"]
    assert tg.program_steps(hp) == [0]
    windows = sorted({tuple(int(w) for w in tg.windows(first, hp)) for first, _ in tg.stage_bounds(hp)})
    assert len(windows) == 4  # every stage's windows, although one program serves them
    expected = ["validation step (final windows)", "MLP fp8 (one layer) xla", "MLP fp8 (one layer) pallas",
                "head + loss fp8 (MTP, prefix) xla", "head + loss fp8 (MTP, prefix) pallas",
                "optimizer step (NorMuon + Adam)", "train step stage 0 (synced) W=128/384",
                "train step stage 0 (pipelined) W=128/384"]
    for impl in tg.ATTENTION:
        expected += [f"attention {impl} W={w}" for w in sorted({w for pair in windows for w in pair})]
        expected += [f"attention {impl} paired W={w}" for w in sorted({s for s, _ in windows})]
        expected.append(f"DC correction {impl}")
    assert set(expected) <= set(rows), set(expected) - set(rows)
    for name, row in rows.items():
        assert set(row) == ROW_FIELDS, name
        assert row["ms"] > 0, name
        assert name in table  # every row is in the printed table too
        assert row["gflop"] > 0 and 0 < row["mfu"] < 1, name
    assert rows["train step stage 0 (synced) W=128/384"]["xla_loop"]  # attention loops: XLA's count is no reference
    assert result["skipped"] == ["model"] and "left out (--skip): model" in table
    assert not [name for name in rows if name.startswith("model")]

    assert result["profile"] is None and "profile:" not in table  # none asked for
