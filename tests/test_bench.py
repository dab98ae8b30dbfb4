"""bench.py: the analytic FLOP counts against independent references, the profile reader on hand-made
traces, bad input, and the whole suite on CPU at the smoke shape (a subprocess)."""
import gzip
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bench
import train_gpt as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B = tg.BLOCK


# ---- FLOP counting


def dense_mask(docs, window):
    """The attention rule as a dense T x T matrix."""
    q, k = np.arange(len(docs))[:, None], np.arange(len(docs))[None, :]
    return (k <= q) & (docs[:, None] == docs[None, :]) & (q // B - k // B < max(window, 1))


@pytest.mark.parametrize("trial", range(6))
def test_attention_pairs_and_tiles_match_the_dense_mask(trial):
    rng = np.random.default_rng()
    T = B * int(rng.integers(1, 7))
    docs = np.cumsum(rng.random(T) < rng.choice([0.0, 0.003, 0.02, 0.2]))
    window = int(rng.integers(0, T // B + 3))
    mask = dense_mask(docs, window)
    assert bench.attention_pairs(docs, window) == mask.sum()
    tiles = mask.reshape(T // B, B, T // B, B).any(axis=(1, 3))
    assert bench.attention_blocks(docs, window) == tiles.sum()


def test_model_flops_count_every_matmul_weight_and_every_causal_pair():
    hp = bench.TINY
    shapes = jax.eval_shape(lambda: tg.init_params(hp, 0))
    matmul = [n for n in shapes if n.endswith(("qkv_w", "c_proj.weight", "c_fc.weight")) or n == "lm_head.weight"]
    assert bench.matmul_weights(hp) == sum(np.prod(shapes[n].shape) for n in matmul)
    T, D = 512, hp.model_dim
    attention_layers = sum(tg.has_attention(i, hp.num_layers) for i in range(hp.num_layers))
    one_document = np.zeros(T, int)
    big = 2 * T // B  # long and short windows cover the whole sequence: plain causal attention
    expected = 6 * bench.matmul_weights(hp) * T + 12 * D * attention_layers * T * (T + 1) // 2
    assert bench.model_flops(hp, one_document[None], big) == expected
    assert bench.model_flops(hp, one_document[None], big, backward=False) == expected // 3
    assert bench.nominal_flops(hp, T, big) == 6 * bench.matmul_weights(hp) * T + 12 * D * attention_layers * (
        T // B - 0.5) * B * T


def test_newton_schulz_flops_match_xla_cost_analysis():
    """tg.newton_schulz is straight-line code (no loop), so XLA's count is a fair reference; elementwise
    work makes it a little larger."""
    for shape in [(4, 64, 256), (2, 256, 64), (96, 96)]:
        compiled = jax.jit(tg.newton_schulz).lower(jnp.ones(shape, jnp.float32)).compile()
        xla, loops = bench.xla_cost(compiled)
        assert not loops
        ours = bench.newton_schulz_flops([shape])
        assert ours <= xla < 1.1 * ours, shape


def test_estimated_run_interpolates_the_step_time_over_the_window_schedule():
    hp = tg.PRESETS["record"]
    assert bench.estimated_run_s(hp, 100.0, 100.0) == pytest.approx(hp.num_iterations * 0.1)
    top = tg.window_blocks(hp.num_iterations, hp)
    windows = [tg.window_blocks(s, hp) for s in range(hp.num_iterations)]
    expected = sum(50.0 + 10.0 * (w - 1) for w in windows) / 1e3  # 50 ms at w=1, +10 ms per block
    assert bench.estimated_run_s(hp, 50.0, 50.0 + 10.0 * (top - 1)) == pytest.approx(expected)


# ---- profile reader


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
        bench.parse_args(["--profile", "somewhere"])
    assert e.value.code == 2 and "--profile needs --suite" in capsys.readouterr().err
    assert bench.main(["--seq-len", "1000"]) == 2
    assert "multiple of 128" in capsys.readouterr().err
    assert bench.main(["--out", str(tmp_path)]) == 2  # a folder: refused before any benchmark runs
    assert "cannot write" in capsys.readouterr().err


# ---- the suite on CPU


ROW_FIELDS = {"ms", "tokens_per_s", "gflop", "tflops", "mfu", "mfu_nominal", "xla_gflop", "xla_loop", "compile_s",
              "note"}


def expected_rows(top):
    rows = ["train step w=1 (synced)", f"train step w={top} (synced)", f"train step w={top} (pipelined)",
            f"validation step w={top}", "embeddings + value embeddings", "MLP (one layer)", "head + loss fp8",
            "head + loss bf16", "optimizer update (Adam + Muon)", "optimizer: Muon alone"]
    rows += [f"model fwd+bwd xla w={w} {head}" for w in (1, top) for head in ("fp8", "bf16")]
    for impl in tg.ATTENTION:
        rows += [f"attention kernel {impl} w={w}" for w in bench.KERNEL_WINDOWS]
        rows += [f"attention layer {impl} w={w}" for w in (1, top // 2, top)]
        if impl != "xla":
            rows.append(f"model fwd+bwd {impl} w={top} fp8")
    return rows


def test_the_suite_runs_on_cpu_and_reports_every_field(tmp_path):
    out = tmp_path / "results" / "suite.txt"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--suite", "--preset", "smoke",
                           "--repeats", "1", "--profile", str(tmp_path / "profile"), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.read_text() == proc.stdout  # the table and the JSON line, both
    table, line = proc.stdout.rstrip("\n").rsplit("\n", 1)
    result = json.loads(line)
    assert result["errors"] == [] and "FAILED" not in table
    hp = bench.PRESETS["smoke"]
    assert result["preset"] == "smoke" and result["sequences_per_device"] == hp.batch_size // hp.seq_len == 2
    top = result["windows"][1]
    assert top == tg.window_blocks(hp.num_iterations, hp) == 2

    assert set(result["compile"]) == {"train_cold_s", "train_warm_s", "val_cold_s", "val_warm_s"}
    assert all(s > 0 for s in result["compile"].values())
    assert result["memory"]["peak_mib"] is None and "n/a" in result["memory"]["peak_source"]
    assert result["memory"]["compiled_peak_mib"] > 0
    t = result["train_step"]
    assert t["ms_w1"] > 0 and t["ms_full_window"] > 0 and t["ms_pipelined"] > 0 and t["tokens_per_s"] > 0
    assert t["estimated_run_s"] > 0 and 0 < t["mfu_nominal"] < 1

    rows = result["rows"]
    assert set(expected_rows(top)) <= set(rows)
    for name, row in rows.items():
        assert set(row) == ROW_FIELDS, name
        assert row["ms"] > 0, name
        assert name in table  # every row is in the printed table too
    for name in expected_rows(top):
        if not name.startswith(("embeddings", f"train step w={top} (pipelined)")):
            assert rows[name]["gflop"] > 0 and 0 < rows[name]["mfu"] < 1, name
            assert rows[name]["xla_gflop"] is not None, name
    assert rows[f"model fwd+bwd xla w={top} fp8"]["xla_loop"]  # the attention loop: XLA's count is no reference
    assert not rows["MLP (one layer)"]["xla_loop"]
    assert [b["part"] for b in result["breakdown"]][-1].startswith("rest")
    assert sum(b["ms"] for b in result["breakdown"]) == pytest.approx(t["ms_pipelined"])

    profile = result["profile"]
    assert 0 < len(profile["top_ops"]) <= bench.TOP_OPS
    for op in profile["top_ops"]:
        assert op["ms"] > 0 and op["count"] > 0 and 0 < op["pct_of_step"] <= 100, op
    assert any(op["jax_op"] for op in profile["top_ops"])
    assert "profile:" in table and profile["top_ops"][0]["op"] in table
