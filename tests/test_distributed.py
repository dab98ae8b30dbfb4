"""Device-count and process-count invariance: one device, 8 devices in one process, and 2 processes
of 4 devices each (jax.distributed, gloo CPU collectives on 127.0.0.1) train the same; and a dead
process stops the others."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from conftest import TINY_FLAGS, TINY_VOCAB
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tiny_args, records, devices, process_id=None, num_processes=None, port=None, **overrides):
    args = tiny_args(records, **overrides)
    if process_id is not None:
        args += ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
                 "--process-id", str(process_id)]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


# The train steps' own losses, which no log holds: train()'s compiled programs (persistent cache hits
# after the tiny runs on 1 and 8 devices) for 4 steps on one batch, then the validation step on it.
TRAIN_LOSSES_SCRIPT = """
import dataclasses, json, sys
import jax, numpy as np
import train_gpt as tg
args, overrides = tg.parse_args(sys.argv[1:])
hp = dataclasses.replace(tg.PRESETS[args.preset], **overrides)
tg.enable_compile_cache(hp.compile_cache_dir)
mesh = tg.make_mesh()
by_rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
optimizer = tg.make_optimizer(hp, mesh)
params, state = tg.initial_state(hp, mesh, optimizer)
train_step, val_step = tg.compile_steps(hp, mesh, params, state, optimizer)
inputs = tg.check_inputs(hp, mesh)
batch = next(tg.token_windows(inputs.train_files, hp.batch_size, hp.seq_len, inputs.rows))
x, y = (jax.device_put(b, by_rows) for b in batch)
losses = []
for step in range(4):  # one batch, seen 4 times: the loss must fall
    params, state, loss = train_step(params, state, x, y, np.int32(tg.window_blocks(step, hp)))
    losses.append(float(loss))
print(json.dumps(losses + [float(val_step(params, x, y, np.int32(2)))]))
"""


def train_losses(tiny_args, records, devices):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.Popen([sys.executable, "-c", TRAIN_LOSSES_SCRIPT, *tiny_args(records)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_one_device_eight_devices_and_two_processes_of_four_train_the_same(tiny_attempt, tiny_args, tmp_path):
    """The tiny run (conftest's attempt, seed 0: one device) against the same flags on 8 devices in one
    process and on 2 processes of 4 devices: the same val curve at every validation; and the train steps'
    losses on 1 and 8 devices. Only the order of float sums differs (8 sequences accumulated on one device
    vs a cross-device mean, reductions across processes), which bf16 activations amplify a little."""
    port = free_port()
    single = launch(tiny_args, tmp_path / "eight", devices=8)  # independent of the pair: started together
    procs = [launch(tiny_args, tmp_path / "two", 4, i, 2, port) for i in range(2)]
    finish(single)
    steps = [train_losses(tiny_args, tmp_path / "steps", n) for n in (1, 8)]  # once both programs are cached
    outs = [finish(p) for p in procs]
    steps_one, steps_eight = (json.loads(finish(p).strip().splitlines()[-1]) for p in steps)
    assert abs(steps_one[0] - np.log(TINY_VOCAB)) < 1e-3
    np.testing.assert_allclose(steps_eight, steps_one, rtol=0, atol=2e-3)
    assert steps_one[-1] < steps_one[0] - 1  # the steps learned the batch
    (eight_log,) = (tmp_path / "eight").iterdir()
    (two_log,) = (tmp_path / "two").iterdir()  # only process 0 writes a log
    assert "val_loss" in outs[0] and "step:" not in outs[1]  # and only process 0 prints (gloo chats anyway)
    one, eight, two = (parse_log(p) for p in (tiny_attempt.logs[0], str(eight_log), str(two_log)))
    assert "in 2 process(es)" in "\n".join(two.environment) and "8 x" in "\n".join(two.environment)
    assert "Devices: 1 x" in "\n".join(one.environment) and "Devices: 8 x" in "\n".join(eight.environment)
    flags = [{k: v for k, v in run.hyperparameters.items() if k != "records_dir"} for run in (one, eight, two)]
    assert flags[0] == flags[1] == flags[2]  # the same run but for its devices
    losses_one, losses_eight, losses_two = ([v for _, v, _ in run.val_curve] for run in (one, eight, two))
    assert len(losses_one) == TINY_FLAGS["--num-iterations"] // TINY_FLAGS["--val-loss-every"] + 1
    assert abs(losses_one[0] - np.log(TINY_VOCAB)) < 1e-3
    np.testing.assert_allclose(losses_eight, losses_one, rtol=0, atol=2e-3)
    np.testing.assert_allclose(losses_two, losses_eight, rtol=0, atol=2e-3)
    assert losses_one[-1] < losses_one[0] - 1  # and the steps did learn something


def test_a_dead_process_makes_the_other_exit_instead_of_hanging(tiny_args, tmp_path):
    """Process 1 is killed once process 0 waits for it in the run's first collective, the step-0
    validation (process 1 is usually still compiling then: only process 0 writes the compile cache,
    and on CPUs the other processes' cache keys differ). Bound: --heartbeat-timeout 10 s plus
    shutdown; the test allows 120 s."""
    port = free_port()
    procs = [launch(tiny_args, tmp_path / "r", 4, i, 2, port, **{"--heartbeat-timeout": 10}) for i in range(2)]
    try:
        for line in procs[0].stdout:
            if line.startswith("validating"):
                break
        procs[1].send_signal(signal.SIGKILL)
        start = time.time()
        procs[0].communicate(timeout=120)  # reads its pipes: a full pipe cannot hold it up
        assert procs[0].returncode != 0
        print(f"survivor exited with {procs[0].returncode} after {time.time() - start:.1f}s")
    finally:
        for p in procs:
            p.kill()
