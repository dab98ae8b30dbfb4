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

from conftest import TINY_VAL_STEPS, TINY_VOCAB
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# train_gpt.py's main() with the tiny flags' preset changed to one MTP weight in every stage: every
# stage runs the same train program, so a cold start compiles one train program instead of three.
ONE_PROGRAM = """import dataclasses, sys
import train_gpt as tg
cpu = tg.PRESETS["cpu"]
tg.PRESETS["cpu"] = dataclasses.replace(cpu, stages=tuple(dataclasses.replace(s, mtp_start=(1.0,), mtp_end=(1.0,))
                                                          for s in cpu.stages))
sys.exit(tg.main(sys.argv[1:]))"""


def launch(tiny_args, records, devices, process_id=None, num_processes=None, port=None, script=None, **overrides):
    """train_gpt.py (or `python -c script`) with the tiny flags on `devices` CPU devices; with
    process_id, one of num_processes processes of a jax.distributed run."""
    args = tiny_args(records, **overrides)
    if process_id is not None:
        args += ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
                 "--process-id", str(process_id)]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    program = ["-c", script] if script else [os.path.join(ROOT, "train_gpt.py")]
    return subprocess.Popen([sys.executable, *program, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_one_device_and_two_processes_of_four_devices_train_the_same(tmp_path, tiny_args):
    """The tiny run with one train program (ONE_PROGRAM; the schedule's program switches are the tiny
    attempt's) on one device scanning the step's 8 chunks, against 2 processes of 4 devices (8
    devices, a chunk each, gradients summed across devices and processes): the same val curve at
    every validation. Only the order of float sums differs, which bf16 activations amplify a little.
    All three compile cold at once: with a shared cache, a process that found its programs there
    would wait for the other at the first collective longer than gloo's 30-second rendezvous allows
    (on CPUs each process's cache keys differ)."""
    port, cold = free_port(), {"--compile-cache-dir": ""}
    procs = [launch(tiny_args, tmp_path / "one", 1, script=ONE_PROGRAM, **cold),
             *[launch(tiny_args, tmp_path / "two", 4, i, 2, port, script=ONE_PROGRAM, **cold) for i in range(2)]]
    outs = [finish(p) for p in procs]
    (one_log,), (two_log,) = (tmp_path / "one").iterdir(), (tmp_path / "two").iterdir()  # process 0 alone logs
    assert "val_loss" in outs[1] and "step:" not in outs[2]  # and only process 0 prints (gloo chats anyway)
    one, two = (parse_log(str(p)) for p in (one_log, two_log))
    assert "in 2 process(es)" in "\n".join(two.environment) and "8 x" in "\n".join(two.environment)
    assert "Devices: 1 x" in "\n".join(one.environment)
    assert "for 1 train program and the validation step" in outs[0]  # ONE_PROGRAM took effect
    flags = [{k: v for k, v in run.hyperparameters.items() if k not in ("records_dir", "compile_cache_dir")}
             for run in (one, two)]
    assert flags[0] == flags[1]  # the same run but for its devices
    losses_one, losses_two = ([v for _, v, _ in run.val_curve] for run in (one, two))
    assert [s for s, *_ in one.val_curve] == [s for s, *_ in two.val_curve] == TINY_VAL_STEPS
    assert abs(losses_one[0] - np.log(TINY_VOCAB)) < 0.01
    np.testing.assert_allclose(losses_two, losses_one, rtol=0, atol=2e-3)
    assert losses_one[-1] < losses_one[0] - 0.3  # and the steps did learn something


def test_a_dead_process_makes_the_other_exit_instead_of_hanging(tiny_args, tmp_path):
    """Process 1 is killed once both have joined the run (process 0 says it is compiling); process 0
    learns it from the coordination service's heartbeat. Bound: --heartbeat-timeout 10 s plus
    shutdown; the test allows 120 s."""
    port = free_port()
    procs = [launch(tiny_args, tmp_path / "r", 4, i, 2, port, **{"--heartbeat-timeout": 10}) for i in range(2)]
    try:
        for line in procs[0].stdout:
            if line.startswith("compiling"):
                break
        procs[1].send_signal(signal.SIGKILL)
        start = time.time()
        procs[0].communicate(timeout=120)  # reads its pipes: a full pipe cannot hold it up
        assert procs[0].returncode != 0
        print(f"survivor exited with {procs[0].returncode} after {time.time() - start:.1f}s")
    finally:
        for p in procs:
            p.kill()
