"""The training loop: gradient accumulation and whole runs of train_gpt.py (record log, errors,
interrupts, the one-step-late loss read). Device-count invariance is in test_distributed."""
import dataclasses
import glob
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train_gpt as tg
from conftest import TINY_FLAGS, TINY_VOCAB
from data.shards import write_shard
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the step: gradient accumulation


def test_accumulated_step_equals_the_average_of_per_sequence_gradients(tiny_hp):
    """4 sequences on one device: the step's gradient is the mean of the 4 per-sequence gradients.
    The step is built with optax.identity() so that new params = params + gradient, exposing it."""
    rng = np.random.default_rng()
    hp = dataclasses.replace(tiny_hp, batch_size=4 * tiny_hp.seq_len, val_tokens=4 * tiny_hp.seq_len)
    train_step, _ = tg.make_steps(hp, tg.make_mesh(), optax.identity())
    params = tg.init_params(hp, 0)
    for k in params:  # the zero-initialised projections and head get values, so every gradient is non-zero
        if k.endswith("c_proj.weight") or k == "lm_head.weight":
            params[k] = jnp.asarray(rng.standard_normal(params[k].shape) * 0.02, jnp.float32)
    tokens = rng.integers(0, hp.vocab_size, (4, hp.seq_len + 1))
    inputs, targets = jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)
    window = jnp.int32(2)

    grad_fn = jax.jit(jax.value_and_grad(tg.loss_fn), static_argnums=4)
    losses, grads = zip(*(grad_fn(params, inputs[r], targets[r], window, True) for r in range(4)))
    mean = jax.tree.map(lambda *g: (sum(x.astype(jnp.float32) for x in g) / 4).astype(g[0].dtype), *grads)
    expected = optax.apply_updates(params, mean)

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


# ---- whole runs of train_gpt.py


def test_a_tiny_run_writes_a_log_that_parses_back(tiny_attempt):
    """The first run of conftest's tiny attempt: train_gpt.py with the tiny flags and --seed 0."""
    log = parse_log(tiny_attempt.logs[0])
    with open(os.path.join(ROOT, "train_gpt.py")) as f:
        assert log.source == f.read()
    assert log.status == "complete"
    N, every = TINY_FLAGS["--num-iterations"], TINY_FLAGS["--val-loss-every"]
    assert log.hyperparameters["num_iterations"] == N and log.preset == "cpu"
    assert [s for s, *_ in log.val_curve] == list(range(0, N + 1, every))
    assert len(log.train_steps) == N
    assert log.val_curve[0][1] == pytest.approx(np.log(TINY_VOCAB), abs=1e-3)
    assert log.val_curve[-1][1] < log.val_curve[0][1] - 2  # the synthetic text is learnable
    assert log.summary["final_val_loss"] == pytest.approx(log.val_curve[-1][1], abs=1e-4)
    assert f"step:{N}/{N} val_loss:{log.val_curve[-1][1]:.4f}" in tiny_attempt.proc.stdout  # printed as well as logged


@pytest.mark.parametrize("case", ["no_shards", "bad_magic", "truncated", "short_val", "seq_len", "records_dir",
                                  "vocab"])
def test_bad_input_fails_before_writing_anything(case, tiny_args, synthetic_shards, tmp_path, capsys):
    """In this process through main(): these fail before anything compiles (the 3-device case below
    shows the same exit code 2 from a process of its own)."""
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
        overrides, expect = {"--seq-len": 1000}, "multiple of 128"
    elif case == "vocab":  # the boundary: a vocabulary that just misses the shards' largest token id
        largest = max(int(tg.open_shard(p).max()) for kind in ("--train-files", "--val-files")
                      for p in glob.glob(synthetic_shards[kind]))
        overrides, expect = {"--vocab-size": largest}, f"holds token id {largest}, but --vocab-size is {largest}"
    elif case == "records_dir":
        (tmp_path / "a_file").write_text("")
        overrides, expect = {"--records-dir": str(tmp_path / "a_file" / "records")}, "records"
    assert tg.main(tiny_args(records, **overrides)) == 2
    err = capsys.readouterr().err
    assert expect in err and err.startswith("error: ") and "Traceback" not in err, err[-2000:]
    assert not records.exists() or not any(records.iterdir())


def test_batch_that_does_not_split_over_devices(tiny_args, run_train, tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    result = run_train(tiny_args(tmp_path / "records"), env=env)
    assert result.returncode == 2 and "cannot be split evenly over 3 devices" in result.stderr, result.stderr[-2000:]


def test_non_finite_loss_stops_and_closes_the_log(tiny_args, run_train, tmp_path):
    records = tmp_path / "records"
    result = run_train(tiny_args(records, **{"--embed-lr": 1e38}))
    assert result.returncode == 1, result.stderr[-2000:]
    (log_path,) = records.iterdir()
    *_, before, last = log_path.read_text().rstrip().splitlines()
    assert last.startswith("stopped: non-finite train loss") and "learning rate" in last
    # numbered as the step lines are: the line before is the last step that finished with a finite loss
    stopped_at = int(re.search(r"at step (\d+)", last).group(1))
    assert before.startswith(f"step:{stopped_at - 1}/") or (stopped_at == 1 and "val_loss" in before), (before, last)


def test_sigterm_ends_the_log_with_interrupted(tiny_args, tmp_path):
    records = tmp_path / "records"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt.py"),
                             *tiny_args(records)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:  # wait until training runs (7 steps, ~2 s, before the end)
            if line.startswith("step:1/"):
                break
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # reads both pipes: a full pipe cannot block the run's exit
        assert proc.returncode == 143, out[-2000:] + err[-2000:]
    finally:
        proc.kill()
    (log_path,) = records.iterdir()
    last = log_path.read_text().rstrip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and "SIGTERM" in last


def test_ctrl_c_while_compiling_writes_no_log_and_no_traceback(tiny_args, tmp_path):
    records = tmp_path / "records"
    cold = tiny_args(records, **{"--compile-cache-dir": ""})  # no cache: a warm one could finish compiling first
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt.py"), *cold],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:
            if line.startswith("compiling"):
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "no record log was written" in out
    assert not records.exists() or not any(records.iterdir())


def test_a_bug_is_not_reported_as_bad_input(monkeypatch, tiny_args, tmp_path):
    """Only the project's own input errors exit 2; a ValueError from the code keeps its traceback."""
    def planted(*args, **kwargs):
        raise ValueError("planted bug")

    monkeypatch.setattr(tg, "loss_fn", planted)
    with pytest.raises(ValueError, match="planted bug"):
        tg.main(tiny_args(tmp_path / "r"))
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_loss_is_read_one_step_late_without_changing_losses_or_lines(tiny_hp, tmp_path, capsys):
    """train() reads step s's loss after dispatching step s + 1: the val losses equal those of a plain
    synchronous loop over the same batches, and every step gets its line, in order, in the record format."""
    hp, N = tiny_hp, tiny_hp.num_iterations
    mesh = tg.make_mesh()
    summary = tg.train(hp, "cpu", mesh, save_path=str(tmp_path / "w.npz"))
    log = parse_log(summary["log"])
    assert [s for s, *_ in log.train_steps] == list(range(1, N + 1))
    step_lines = [l for l in open(summary["log"]).read().splitlines() if l.startswith("step:") and "val_loss" not in l]
    assert all(re.fullmatch(rf"step:\d+/{N} train_time:\d+ms step_avg:\d+\.\d\dms", l) for l in step_lines)
    assert "ETA" in capsys.readouterr().out  # on the console only

    optimizer = tg.make_optimizer(hp, mesh)
    params, state = tg.initial_state(hp, mesh, optimizer)  # as train() starts
    inputs = tg.check_inputs(hp, mesh)
    train_step, val_step = tg.compile_steps(hp, mesh, params, state, optimizer)
    batches = tg.token_windows(inputs.train_files, hp.batch_size, hp.seq_len, inputs.rows)
    val_losses = []
    for step in range(N + 1):
        window = np.int32(tg.window_blocks(step, hp))
        if step % hp.val_loss_every == 0:
            val_losses.append(np.mean([float(val_step(params, x, y, window)) for x, y in inputs.val_batches]))
        if step < N:
            x, y = next(batches)
            params, state, loss = train_step(params, state, x, y, window)
            float(loss)
    np.testing.assert_allclose([v for _, v, *_ in log.val_curve], val_losses, rtol=0, atol=1e-4)
    saved = tg.load_weights(str(tmp_path / "w.npz"), hp)  # --save-weights wrote the trained weights
    for name, p in params.items():
        np.testing.assert_allclose(np.asarray(saved[name], np.float32), np.asarray(p, np.float32), atol=1e-5)
