"""Device-count and process-count invariance: one device, and 2 processes of 4 devices each
(jax.distributed, gloo CPU collectives on 127.0.0.1) train the same; and a dead process stops the
others."""
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import TINY_VAL_STEPS, TINY_VOCAB, host_devices_env
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tiny_args, records, devices, process_id=None, num_processes=None, port=None, **overrides):
    """train_gpt.py with the tiny flags on `devices` CPU devices; with process_id, one of
    num_processes processes of a jax.distributed run."""
    args = tiny_args(records, **overrides)
    if process_id is not None:
        args += ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
                 "--process-id", str(process_id)]
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt.py"), *args], cwd=ROOT,
                            env=host_devices_env(devices),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.heavy(2)
def test_one_device_and_two_processes_of_four_devices_train_the_same(request, tiny_args, tmp_path):
    """The tiny run (conftest's attempt, seed 0: one device scanning the step's 8 chunks) against the
    same flags on 2 processes of 4 devices (8 devices, a chunk each, gradients summed across devices
    and processes): the same val curve at every validation. Only the order of float sums differs,
    which bf16 activations amplify a little. The pair compiles cold, both processes alike: with the
    shared cache process 0 would load its programs at once (on CPUs the other process's cache keys
    differ) and wait for process 1 at the first collective longer than gloo's 30-second rendezvous
    allows. The attempt is asked for only once the pair has finished: if the other worker is still
    making it, this one trains meanwhile instead of waiting for it."""
    port = free_port()
    procs = [launch(tiny_args, tmp_path / "two", 4, i, 2, port, **{"--compile-cache-dir": ""}) for i in range(2)]
    outs = [finish(p) for p in procs]
    tiny_attempt = request.getfixturevalue("tiny_attempt")
    (two_log,) = (tmp_path / "two").iterdir()  # only process 0 writes a log
    assert "val_loss" in outs[0] and "step:" not in outs[1]  # and only process 0 prints (gloo chats anyway)
    one, two = (parse_log(p) for p in (tiny_attempt.logs[0], str(two_log)))
    assert "in 2 process(es)" in "\n".join(two.environment) and "8 x" in "\n".join(two.environment)
    assert "Devices: 1 x" in "\n".join(one.environment)
    flags = [{k: v for k, v in run.hyperparameters.items() if k not in ("records_dir", "compile_cache_dir")}
             for run in (one, two)]
    assert flags[0] == flags[1]  # the same run but for its devices
    losses_one, losses_two = ([v for _, v, _ in run.val_curve] for run in (one, two))
    assert [s for s, *_ in one.val_curve] == [s for s, *_ in two.val_curve] == TINY_VAL_STEPS
    assert abs(losses_one[0] - np.log(TINY_VOCAB)) < 0.01
    np.testing.assert_allclose(losses_two, losses_one, rtol=0, atol=2e-3)
    assert losses_one[-1] < losses_one[0] - 0.3  # and the steps did learn something


EXCHANGE_CHECK = """
import jax, jax.numpy as jnp, numpy as np
import train_gpt as tg
mesh, rng = tg.make_mesh(), np.random.default_rng()
P = jax.sharding.PartitionSpec
for shape, axis, dtype in [((8, 6), 0, jnp.bfloat16), ((6, 8), 1, jnp.bfloat16), ((6, 5), 0, jnp.bfloat16),
                           ((3,), None, jnp.float32)]:
    g = jax.device_put(jnp.asarray(rng.standard_normal((4, *shape)), dtype), jax.sharding.NamedSharding(mesh, P("dp")))
    out = jax.jit(lambda g: tg.exchange_gradient(mesh, 8, g, axis))(g)
    g64 = np.asarray(g.astype(jnp.float32), np.float64)
    want = g64.sum(0) / 8
    assert out.dtype == dtype and out.shape == shape, (shape, out.dtype, out.shape)
    assert out.sharding.spec == tg.update_spec(4, shape, axis) == (P("dp") if axis == 0 and shape[0] == 8 else
                                                                   P(None, "dp") if axis == 1 else P()), out.sharding
    tol = 2 ** -7 * np.abs(g64).sum(0) / 8 + 1e-7  # bf16 sums' rounding
    assert np.all(np.abs(np.asarray(out.astype(jnp.float32), np.float64) - want) <= tol), shape
print("exchanged")
"""


def test_the_exchange_averages_over_the_chunks_and_splits_as_the_update():
    """exchange_gradient on 4 CPU devices that hold 2 of the step's 8 chunks each: the devices' sums
    averaged over the 8 chunks (not the 4 devices), in the gradient's dtype, reduce-scattered along the
    parameter's split axis (rows, or lm_head's columns) or whole on every device where it does not split
    evenly or has none, against float64."""
    result = subprocess.run([sys.executable, "-c", EXCHANGE_CHECK], cwd=ROOT, env=host_devices_env(4),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "exchanged" in result.stdout, result.stderr[-3000:]


@pytest.mark.heavy(3)
def test_a_dead_process_makes_the_other_exit_instead_of_hanging(tiny_args, tmp_path):
    """Process 1 is killed once both have joined the run (process 0 says it is checking shards: past
    jax.distributed's start, which waits for every process; killed later, while compiling, the pair
    cost 28 s of CPU instead of 8); process 0 learns it from the coordination service's heartbeat.
    Bound: --heartbeat-timeout 10 s plus shutdown; the test allows 120 s."""
    port = free_port()
    procs = [launch(tiny_args, tmp_path / "r", 4, i, 2, port, **{"--heartbeat-timeout": 10}) for i in range(2)]
    try:
        for line in procs[0].stdout:
            if line.startswith("checking shards"):
                break
        else:
            pytest.fail(f"process 0 ended before checking shards: {procs[0].stderr.read()[-3000:]}")
        procs[1].send_signal(signal.SIGKILL)
        start = time.time()
        procs[0].communicate(timeout=120)  # reads its pipes: a full pipe cannot hold it up
        assert procs[0].returncode != 0
        print(f"survivor exited with {procs[0].returncode} after {time.time() - start:.1f}s")
    finally:
        for p in procs:
            p.kill()
