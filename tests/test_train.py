"""The training loop: device-count invariance, gradient accumulation, the loader's virtual-rank rule,
and whole runs of train_gpt.py (record log, errors, interrupts)."""
import dataclasses
import json
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train_gpt as tg
from data.shards import ShardError, write_shard
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dataclasses.replace(tg.PRESETS["cpu"], seq_len=128, batch_size=1024, val_tokens=2048, num_iterations=24,
                           val_loss_every=8, compile_cache_dir="")


# ---- loader


def reference_batches(shards, batch_size, seq_len, rows):
    """The spec's loader written as the reference loop: check, slice each rank, advance."""
    shard_iter = iter(shards)
    tokens, pos = next(shard_iter), 0
    while True:
        if pos + batch_size + 1 >= len(tokens):
            try:
                tokens, pos = next(shard_iter), 0
            except StopIteration:
                return
            if pos + batch_size + 1 >= len(tokens):
                continue
        yield ([tokens[pos + r * seq_len: pos + r * seq_len + seq_len] for r in rows],
               [tokens[pos + r * seq_len + 1: pos + r * seq_len + seq_len + 1] for r in rows])
        pos += batch_size


def test_loader_follows_the_virtual_rank_rule_across_shard_boundaries(tmp_path):
    rng = np.random.default_rng()
    B, S = 512, 128
    sizes = [int(rng.integers(3 * B, 4 * B)), 2 * B + 1, B + 1, int(rng.integers(2 * B + 2, 3 * B))]  # B+1: no step fits
    shards = [rng.integers(0, 65536, n).astype(np.uint16) for n in sizes]
    paths = [str(tmp_path / f"t_{i:06d}.bin") for i in range(len(shards))]
    for p, s in zip(paths, shards):
        write_shard(p, s)
    assert tg.steps_available(paths, B) == len(list(reference_batches(shards, B, S, range(4))))
    for rows in (range(0, 4), range(2, 4), range(1, 2)):  # all virtual ranks, or one process's share
        got = list(tg.token_windows(paths, B, S, rows))
        want = list(reference_batches(shards, B, S, rows))
        assert len(got) == len(want) > 0
        for (x, y), (wx, wy) in zip(got, want):
            assert x.dtype == np.int32 and x.shape == (len(rows), S)
            np.testing.assert_array_equal(x, np.stack(wx))
            np.testing.assert_array_equal(y, np.stack(wy))


def test_loader_rejects_bad_shards_naming_the_file(tmp_path):
    good = str(tmp_path / "a_000000.bin")
    write_shard(good, np.arange(4096) % 1000)
    bad = str(tmp_path / "b_000001.bin")
    with open(good, "rb") as f:
        data = f.read()
    with open(bad, "wb") as f:
        f.write(data[:-100])  # truncated
    with pytest.raises(ShardError, match="b_000001.bin"):
        list(tg.token_windows([good, bad], 1024, 128, range(8)))
    with pytest.raises(ShardError, match="b_000001.bin"):
        tg.steps_available([good, bad], 1024)


# ---- the step: accumulation and device count


def test_accumulated_step_equals_the_average_of_per_sequence_gradients():
    """4 sequences on one device: the step's gradient is the mean of the 4 per-sequence gradients.
    The step is built with optax.identity() so that new params = params + gradient, exposing it."""
    rng = np.random.default_rng()
    hp = dataclasses.replace(TINY, batch_size=4 * TINY.seq_len, val_tokens=4 * TINY.seq_len)
    train_step, _ = tg.make_steps(hp, tg.make_mesh(), optax.identity())
    params = tg.init_params(hp, 0)
    for k in params:  # the zero-initialised projections and head get values, so every gradient is non-zero
        if k.endswith("c_proj.weight") or k == "lm_head.weight":
            params[k] = jnp.asarray(rng.standard_normal(params[k].shape) * 0.02, jnp.float32)
    tokens = rng.integers(0, 3000, (4, hp.seq_len + 1))
    inputs, targets = jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)
    window = jnp.int32(2)

    grad_fn = jax.jit(jax.grad(tg.loss_fn), static_argnums=4)
    grads = [grad_fn(params, inputs[r], targets[r], window, True) for r in range(4)]
    mean = jax.tree.map(lambda *g: (sum(x.astype(jnp.float32) for x in g) / 4).astype(g[0].dtype), *grads)
    expected = optax.apply_updates(params, mean)
    loss_fn = jax.jit(tg.loss_fn, static_argnums=4)
    losses = [float(loss_fn(params, inputs[r], targets[r], window, True)) for r in range(4)]

    new_params, _, loss = train_step(jax.tree.map(jnp.copy, params), optax.identity().init(params), inputs, targets,
                                     window)
    np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-4)
    for k in expected:
        got, want = np.asarray(new_params[k], np.float32), np.asarray(expected[k], np.float32)
        step = np.abs(want - np.asarray(params[k], np.float32)).max()
        assert step > 0, k  # every parameter gets a gradient
        # bf16 activations round differently inside the fused step: ~1% of the step; summing instead
        # of averaging would be 300% off, dropping a sequence ~25%
        np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * step + 1e-7, err_msg=k)


DEVICE_SCRIPT = """
import os, sys, json
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=" + sys.argv[1]
sys.path.insert(0, sys.argv[2])
import dataclasses, jax, jax.numpy as jnp, numpy as np
import train_gpt as tg
hp = dataclasses.replace(tg.PRESETS["cpu"], seq_len=128, batch_size=8 * 128, val_tokens=1024, num_layers=6)
mesh = tg.make_mesh()
assert mesh.size == int(sys.argv[1])
optimizer = tg.make_optimizer(hp, mesh)
train_step, val_step = tg.make_steps(hp, mesh, optimizer)
rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
params = jax.jit(tg.init_params, static_argnums=(0, 1))(hp, 0)
state = optimizer.init(params)
rng = np.random.default_rng(int(sys.argv[3]))
losses = []
tokens = rng.integers(0, 3000, (8, hp.seq_len + 1))  # one batch, seen 4 times: the loss must fall
x, y = (jax.device_put(jnp.asarray(t, jnp.int32), rows) for t in (tokens[:, :-1], tokens[:, 1:]))
for step in range(4):
    params, state, loss = train_step(params, state, x, y, jnp.int32(step + 1))
    losses.append(float(loss))
losses.append(float(val_step(params, x, y, jnp.int32(2))))
print(json.dumps(losses))
"""


def run_devices(n, seed):
    result = subprocess.run([sys.executable, "-c", DEVICE_SCRIPT, str(n), ROOT, str(seed)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_one_device_and_eight_devices_compute_the_same_losses():
    seed = int(np.random.default_rng().integers(1 << 30))
    one, eight = run_devices(1, seed), run_devices(8, seed)
    assert abs(one[0] - np.log(50304)) < 1e-3
    # Same math; only the order of float sums differs (8 accumulated micro-steps on one device vs
    # a cross-device mean), which bf16 activations amplify a little over 3 updates.
    np.testing.assert_allclose(one, eight, rtol=0, atol=2e-3)
    assert one[-1] < one[0] - 1  # and the steps did learn something


# ---- whole runs of train_gpt.py


@pytest.fixture
def shards(synthetic_shards):
    return synthetic_shards


def tiny_args(shards, records, **overrides):
    args = {"--preset": "cpu", "--seq-len": TINY.seq_len, "--batch-size": TINY.batch_size,
            "--val-tokens": TINY.val_tokens, "--num-iterations": TINY.num_iterations,
            "--val-loss-every": TINY.val_loss_every, "--records-dir": records, "--compile-cache-dir": "", **shards}
    args.update(overrides)
    return [str(x) for kv in args.items() for x in kv]


def run_train(args, **kwargs):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py"), *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, **kwargs)


def test_a_tiny_run_writes_a_log_that_parses_back(shards, tmp_path):
    records = tmp_path / "records"
    result = run_train(tiny_args(shards, records))
    assert result.returncode == 0, result.stderr[-3000:]
    (log_path,) = records.iterdir()
    log = parse_log(str(log_path))
    with open(os.path.join(ROOT, "train_gpt.py")) as f:
        assert log.source == f.read()
    assert log.status == "complete"
    assert log.hyperparameters["num_iterations"] == TINY.num_iterations and log.preset == "cpu"
    assert [s for s, *_ in log.val_curve] == [0, 8, 16, 24]
    assert len(log.train_steps) == TINY.num_iterations
    assert log.val_curve[0][1] == pytest.approx(np.log(50304), abs=1e-3)
    assert log.val_curve[-1][1] < log.val_curve[0][1] - 2  # the synthetic text is learnable
    assert log.summary["final_val_loss"] == pytest.approx(log.val_curve[-1][1], abs=1e-4)
    assert "step:24/24 val_loss:" in result.stdout  # printed as well as logged


@pytest.mark.parametrize("case", ["no_shards", "bad_magic", "truncated", "short_val", "seq_len", "records_dir"])
def test_bad_input_fails_before_writing_anything(case, shards, tmp_path):
    records = tmp_path / "records"
    overrides, expect = {}, ""
    bad = tmp_path / "bad_000001.bin"
    if case == "no_shards":
        overrides, expect = {"--train-files": str(tmp_path / "nothing_*.bin")}, "cached_fineweb10B.py"
    elif case in ("bad_magic", "truncated"):
        write_shard(str(bad), np.arange(100_000) % 5000)
        data = bytearray(bad.read_bytes())
        if case == "bad_magic":
            data[0] ^= 0xFF
        bad.write_bytes(bytes(data[:-2]) if case == "truncated" else bytes(data))
        overrides, expect = {"--train-files": str(bad)}, "bad_000001.bin"
    elif case == "short_val":
        overrides, expect = {"--val-tokens": 1024 * 1024}, "--val-tokens"
    elif case == "seq_len":
        overrides, expect = {"--seq-len": 1000}, "not a multiple of 128"
    elif case == "records_dir":
        (tmp_path / "a_file").write_text("")
        overrides, expect = {"--records-dir": str(tmp_path / "a_file" / "records")}, "records"
    result = run_train(tiny_args(shards, records, **overrides))
    assert result.returncode == 2, result.stderr[-2000:]
    assert expect in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not records.exists() or not any(records.iterdir())


def test_batch_that_does_not_split_over_devices(shards, tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    result = run_train(tiny_args(shards, tmp_path / "records"), env=env)
    assert result.returncode == 2 and "cannot be split evenly over 3 devices" in result.stderr, result.stderr[-2000:]


def test_non_finite_loss_stops_and_closes_the_log(shards, tmp_path):
    records = tmp_path / "records"
    result = run_train(tiny_args(shards, records, **{"--embed-lr": 1e38}))
    assert result.returncode == 1, result.stderr[-2000:]
    (log_path,) = records.iterdir()
    last = log_path.read_text().rstrip().splitlines()[-1]
    assert last.startswith("stopped: non-finite") and "at step" in last


def test_sigterm_ends_the_log_with_interrupted(shards, tmp_path):
    records = tmp_path / "records"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt.py"),
                             *tiny_args(shards, records, **{"--num-iterations": 50, "--val-loss-every": 0})],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:  # wait until training runs
            if line.startswith("step:3/"):
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        proc.kill()
    (log_path,) = records.iterdir()
    last = log_path.read_text().rstrip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and "SIGTERM" in last
