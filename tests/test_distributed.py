"""Several processes (jax.distributed, gloo CPU collectives on 127.0.0.1) against one process."""
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STEPS = 3


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tiny_args, records, devices, process_id=None, num_processes=None, port=None, **overrides):
    args = tiny_args(records, **{"--num-iterations": STEPS, "--val-loss-every": 1, **overrides})
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


def test_two_processes_of_four_devices_match_one_process_of_eight(tiny_args, tmp_path):
    single = launch(tiny_args, tmp_path / "one", devices=8)
    finish(single)
    port = free_port()
    procs = [launch(tiny_args, tmp_path / "two", 4, i, 2, port) for i in range(2)]
    outs = [finish(p) for p in procs]
    (one_log,) = (tmp_path / "one").iterdir()
    (two_log,) = (tmp_path / "two").iterdir()  # only process 0 writes a log
    assert "val_loss" in outs[0] and "step:" not in outs[1]  # and only process 0 prints (gloo chats anyway)
    one, two = parse_log(str(one_log)), parse_log(str(two_log))
    assert "in 2 process(es)" in "\n".join(two.environment) and "8 x" in "\n".join(two.environment)
    losses_one = [v for _, v, _ in one.val_curve]
    losses_two = [v for _, v, _ in two.val_curve]
    assert len(losses_one) == STEPS + 1
    # identical math; cross-process reductions may sum in another order
    np.testing.assert_allclose(losses_two, losses_one, rtol=0, atol=2e-3)
    assert losses_one[-1] < losses_one[0] - 0.5


def test_a_dead_process_makes_the_other_exit_instead_of_hanging(tiny_args, tmp_path):
    """Bound: --heartbeat-timeout 10 s plus shutdown; the test allows 120 s."""
    port = free_port()
    long_run = {"--num-iterations": 50, "--val-loss-every": 0, "--heartbeat-timeout": 10}
    procs = [launch(tiny_args, tmp_path / "r", 4, i, 2, port, **long_run) for i in range(2)]
    try:
        for line in procs[0].stdout:  # wait until both train
            if line.startswith("step:2/"):
                break
        procs[1].send_signal(signal.SIGKILL)
        start = time.time()
        procs[0].wait(timeout=120)
        assert procs[0].returncode != 0
        print(f"survivor exited with {procs[0].returncode} after {time.time() - start:.1f}s")
    finally:
        for p in procs:
            p.kill()
