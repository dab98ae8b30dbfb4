"""Device-count and process-count invariance: one device, and 2 processes of 4 devices each
(jax.distributed, gloo CPU collectives on 127.0.0.1) train the same; and a dead process stops the
others."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_gpt as tg
from conftest import TINY_VAL_STEPS, TINY_VOCAB, host_devices_env
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Runs a script as `python -c SHARED_COMPILE script args...` would run it as `python script args...`, except
# that the processes of a jax.distributed run compile each program once between them: with
# jax_share_binary_between_hosts, process 0 compiles and hands the executable to the others through the
# coordinator. JAX pairs the processes' programs by their persistent-cache key, which hashes the devices'
# topology; on CPUs each process's topology holds only its own devices, so the keys differ and every
# process would wait for a program that never comes. Here the key hashes the devices' kinds instead (JAX's
# own fallback for backends without a topology). A process that traces another program than process 0's
# keeps another key: it fails when the wait below runs out (2 minutes), as a test should.
SHARED_COMPILE = """
import runpy, sys
from jax._src import cache_key
cache_key._hash_accelerator_config = cache_key._hash_devices
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def launch(tiny_args, records, devices, process_id=None, num_processes=None, port=None, share_compile=False,
           code=None, **overrides):
    """train_gpt.py with the tiny flags on `devices` CPU devices; with process_id, one of
    num_processes processes of a jax.distributed run; with share_compile, its processes compile once
    (SHARED_COMPILE; needs the persistent cache on); with code, `python -c code` and the flags instead."""
    args = tiny_args(records, **overrides)
    if process_id is not None:
        args += ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
                 "--process-id", str(process_id)]
    env, python = host_devices_env(devices), [sys.executable]
    if share_compile:
        env.update(JAX_SHARE_BINARY_BETWEEN_HOSTS="true", JAX_SHARE_BINARY_BETWEEN_HOSTS_TIMEOUT_MS="120000")
        python.extend(["-c", SHARED_COMPILE])
    script = ["-c", code] if code else [os.path.join(ROOT, "train_gpt.py")]
    return subprocess.Popen([*python, *script, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


@pytest.mark.heavy(4)
def test_one_device_and_two_processes_of_four_devices_train_the_same(request, tiny_args, tmp_path):
    """The tiny run (conftest's attempt, seed 0: one device scanning the step's 8 chunks) against the
    same flags on 2 processes of 4 devices (8 devices, a chunk each, gradients summed across devices
    and processes): the same val curve at every validation. Only the order of float sums differs,
    which bf16 activations amplify a little. The pair compiles its programs once, in process 0
    (SHARED_COMPILE: 31 s of CPU less than a compile in each), into a cache of its own, which both
    processes miss alike (one that found the program there while the other did not would wait for a
    hand-over that never comes). The attempt is asked for only once the pair has finished: if the
    other worker is still making it, this one trains meanwhile instead of waiting for it."""
    port = free_port()
    procs = [launch(tiny_args, tmp_path / ("two" if i == 0 else "two_process_1"), 4, i, 2, port, share_compile=True,
                    **{"--compile-cache-dir": tmp_path / "cache"}) for i in range(2)]
    outs = [finish(p) for p in procs]
    tiny_attempt = request.getfixturevalue("tiny_attempt")
    (two_log,) = (tmp_path / "two").iterdir()  # only process 0 writes a log
    assert not (tmp_path / "two_process_1").exists()  # nor makes a folder for one elsewhere
    assert "val_loss" in outs[0] and "step:" not in outs[1]  # and only process 0 prints (gloo chats anyway)
    one, two = (parse_log(p) for p in (tiny_attempt.logs[0], str(two_log)))
    assert "in 2 process(es)" in "\n".join(two.environment) and "8 x" in "\n".join(two.environment)
    assert "Devices: 1 x" in "\n".join(one.environment)
    assert "--xla_gpu_enable_triton_gemm=false" in "\n".join(two.environment)  # the flags it ran with
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


PROBE_VISIBLE_GPUS = """
import sys
import jax
import train_gpt as tg
args, _ = tg.parse_args(sys.argv[1:])
tg.start_distributed(tg.distributed_settings(args))
print("cuda visible devices:", jax.config.values["jax_cuda_visible_devices"])
"""


def test_a_process_given_its_peers_by_hand_keeps_every_gpu_inside_a_slurm_job():
    """Inside a SLURM job (its variables set), JAX's cluster detection gives a process the GPU of its local
    rank only, even with the coordinator, count and id given; a process given them by hand (two processes of
    4 GPUs on one machine, say) must keep all it sees. Read from JAX's setting, as a CPU can show it."""
    slurm = {"SLURM_JOB_ID": "77", "SLURM_LOCALID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
             "SLURM_STEP_NODELIST": "localhost"}
    by_hand = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "1", "--process-id", "0"]
    out = subprocess.run([sys.executable, "-c", PROBE_VISIBLE_GPUS, *by_hand], cwd=ROOT, env={**os.environ, **slurm},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cuda visible devices: all" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.heavy(3)
def test_a_signal_to_one_process_stops_every_process_at_the_same_step(tiny_args, tmp_path):
    """SIGINT to process 1 alone (a process may see a signal steps after the others, or alone): both stop
    before the same step, two after the one process 1 was at, and exit 130; process 0's log ends as a
    one-process run's does. Before, process 1 stopped and process 0 waited in the next step's collectives
    for ever. 8 + 1 steps (the test shards hold 9): the stop comes before the last (the pair compiles once, as
    above)."""
    port = free_port()
    procs = [launch(tiny_args, tmp_path / "r", 4, i, 2, port, share_compile=True,
                    **{"--compile-cache-dir": tmp_path / "cache", "--num-scheduled-iterations": 8})
             for i in range(2)]
    try:
        for line in procs[0].stdout:
            if line.startswith("step:2/"):
                break
        procs[1].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=180) for p in procs]  # each reads its pipes: a full one cannot block it
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [130, 130], [err[-2000:] for _, err in outs]
    (log_path,) = (tmp_path / "r").iterdir()
    *_, before, last = log_path.read_text().rstrip().splitlines()
    stopped_at = int(re.search(r"^interrupted at step (\d+) \(SIGINT\)$", last).group(1))
    assert 4 <= stopped_at < 9 and before.startswith(f"step:{stopped_at}/9 "), (before, last)


SAME_EVERYWHERE = """
import dataclasses, sys
import train_gpt as tg
port, pid, seed = sys.argv[1:]
args, _ = tg.parse_args(["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", pid])
tg.start_distributed(tg.distributed_settings(args))
hp = dataclasses.replace(tg.PRESETS["cpu"], seed=int(seed), records_dir=f"records{pid}",
                         compile_cache_dir=f"/home/u{pid}")
try:
    tg.assert_same_everywhere(hp, "cpu")
    print("same")
except AssertionError as e:
    print("refused:", e)
"""


def test_processes_must_train_the_same_hyperparameters_but_may_keep_their_own_folders():
    """Two processes whose hyperparameters differ only in their host's folders (the log's, the compile cache
    under each $HOME) train; a seed of their own is refused, in both."""
    for seeds, verdict in [((0, 0), "same"), ((0, 1), "refused: processes were started with different hyper")]:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-c", SAME_EVERYWHERE, str(port), str(pid), str(seed)], cwd=ROOT,
                                  env=host_devices_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for pid, seed in enumerate(seeds)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(verdict in out for out, _ in outs), [(out, err[-1500:]) for out, err in outs]


def test_the_exchange_averages_over_the_chunks_and_splits_as_the_update():
    """exchange_gradient on 4 CPU devices that hold 2 of the step's 8 chunks each: the devices' sums
    averaged over the 8 chunks (not the 4 devices), in the gradient's dtype, reduce-scattered along the
    parameter's split axis (rows, or lm_head's columns) or whole on every device where it does not split
    evenly or has none, against float64."""
    result = subprocess.run([sys.executable, "-c", EXCHANGE_CHECK], cwd=ROOT, env=host_devices_env(4),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "exchanged" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("failing, weights", [(1, "missing"), (0, "unreadable")])
def test_a_process_whose_input_checks_fail_stops_the_others_at_once(failing, weights, tiny_args, tmp_path):
    """One process is given --init-weights that do not exist, or exist but cannot be read: it says so,
    and the other, whose own checks passed, says which process stopped, both at once (exit 2). Before,
    the other waited at its first collective (placing the weights) while the stopped one waited in
    JAX's shutdown, minutes (--heartbeat-timeout 60 keeps a hang past the test's 50 s bound)."""
    port, path = free_port(), tmp_path / "weights.npz"
    if weights == "unreadable":
        path.write_bytes(b"not an npz file")
    t = time.monotonic()
    procs = [launch(tiny_args, tmp_path / "r", 4, i, 2, port,
                    **{"--heartbeat-timeout": 60, **({"--init-weights": path} if i == failing else {})})
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=50) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [2, 2], [err[-2000:] for _, err in outs]
    assert time.monotonic() - t < 30
    want = {"missing": f"error: --init-weights {str(path)!r} is not a file",
            "unreadable": f"error: cannot read weights {path} ("}[weights]
    assert want in outs[failing][1]
    assert f"error: process {failing} stopped during its input checks" in outs[1 - failing][1]


@pytest.mark.heavy(2)
def test_a_dead_process_makes_the_other_exit_instead_of_hanging(tiny_args, tmp_path):
    """Process 1 is killed once both have joined the run (process 0 says it is checking shards: past
    jax.distributed's start, which waits for every process; killed later, while compiling, the pair
    cost 28 s of CPU instead of 8); process 0 learns it from the coordination service's heartbeat.
    Bound: --heartbeat-timeout 10 s plus shutdown; the test allows 120 s."""
    port = free_port()
    procs = [launch(tiny_args, tmp_path / "r", 4, i, 2, port, **{"--heartbeat-timeout": 10}) for i in range(2)]
    try:
        # anywhere in a line: gloo's threads print theirs in pieces, which ours may land between (measured:
        # "[Gloo] Rank 0 is connected to checking shards and flags ...", 1 pair in 12 beside two busy-loops)
        seen = []
        for line in procs[0].stdout:
            seen.append(line)
            if "checking shards" in line:
                break
        else:
            err = procs[0].stderr.read()[-3000:]  # (exit code -9 with nothing on stderr: the kernel's OOM killer)
            pytest.fail(f"process 0 ended (exit code {procs[0].wait()}) before checking shards: {err}\n"
                        f"its output: {''.join(seen)[-3000:]}")
        procs[1].send_signal(signal.SIGKILL)
        start = time.time()
        procs[0].communicate(timeout=120)  # reads its pipes: a full pipe cannot hold it up
        assert procs[0].returncode != 0
        print(f"survivor exited with {procs[0].returncode} after {time.time() - start:.1f}s")
    finally:
        for p in procs:
            p.kill()


# train_gpt.py with one failure after the input checks, in this process alone: placing the weights on its
# devices raises a RuntimeError (as a device's out-of-memory error would) or a DataError (as reading a shard
# gone under a running job would); `kind` is defined before it.
FAILS_AFTER_ITS_CHECKS = """
import sys
import train_gpt as tg
error = tg.DataError("a train shard went missing") if kind == "data" else RuntimeError("the devices are full")
def failing(*args, **kwargs):
    raise error
tg.initial_state = failing
sys.exit(tg.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("kind", ["bug", "data"])
def test_a_process_failing_after_the_checks_leaves_at_once_and_the_others_follow(tiny_args, tmp_path, kind):
    """Process 1 fails once every process has passed its input checks: it prints main's message (a
    traceback, or a data error's line) and exits with main's code at once, without JAX's shutdown barrier;
    process 0, waiting for it in a collective, stops too (here the collective placing the weights, gloo's,
    fails when the peer's connection closes, within 3 s; a step's collective does not notice, and the
    coordination service ends the process within --heartbeat-timeout: a reviewer measured 6 s at 10 s, 22 s
    at 30). Before, process 1 sat in the shutdown barrier for 5 minutes, its connection open, and process 0
    in the collective: the test's 60 s ran out (measured)."""
    port, flags = free_port(), {"--heartbeat-timeout": 10}
    procs = [launch(tiny_args, tmp_path / "r", 4, 0, 2, port, **flags),
             launch(tiny_args, tmp_path / "r", 4, 1, 2, port, code=f"kind = {kind!r}" + FAILS_AFTER_ITS_CHECKS,
                    **flags)]
    try:
        start = time.time()
        _, err1 = procs[1].communicate(timeout=60)
        left_after = time.time() - start
        procs[0].communicate(timeout=60)
        followed_after = time.time() - start
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == (2 if kind == "data" else 1), err1[-3000:]
    message = "error: a train shard went missing" if kind == "data" else "RuntimeError: the devices are full"
    assert message in err1 and "process 1 stops at once" in err1, err1[-3000:]
    assert procs[0].returncode != 0
    print(f"process 1 left after {left_after:.1f}s, process 0 after {followed_after:.1f}s")


def test_a_device_sums_its_chunks_gradients_and_adds_the_embedding_rows_in_place(tiny_hp, monkeypatch):
    """device_step on one device scanning 3 chunks whose tokens repeat within and across them, its model
    a stand-in that reads the token and bigram rows and lm_head: every gradient is the sum of the chunks'
    own, as autodiff gives them through embedding's backward (in float64), and the tables' rows that no
    token reads are exactly zero."""
    hp, rng = tiny_hp, np.random.default_rng()
    params = {n: jnp.asarray(rng.standard_normal(v.shape), v.dtype)
              for n, v in tg.trainable(tg.init_params(hp, 0), hp).items()}
    c = {n: jnp.asarray(rng.standard_normal((128, hp.model_dim)), jnp.bfloat16)
         for n in ("embed.weight", "bigram_embed.weight", "lm_head.weight")}

    def stand_in(p, x_T, y_T, a, training, mlp_scales, prefix_T, attention, mlp, head, rows, dc):
        # linear in what it reads, with bf16 coefficients: its cotangents are bf16 values exactly, on either path
        read = {**rows, "lm_head.weight": p["lm_head.weight"][:, y_T].T}
        losses = sum(jnp.sum(tg.f32(read[n]) * tg.f32(c[n]), axis=1) for n in c)
        return jnp.sum(losses), losses, jnp.zeros(tg.NUM_LAYERS)

    def one_chunk(p, x_T, y_T):  # the stand-in through embedding, as gpt_hidden looks the rows up itself
        rows = {n: tg.embedding(p[n], ids) for n, ids in tg.row_ids(p, x_T).items()}
        return stand_in(p, x_T, y_T, tg.schedule_values(3, hp), *[None] * 6, rows, None)[0]

    tokens = jnp.asarray(rng.integers(0, 40, (3, 129)), jnp.int32)  # 40 ids: each row read many times
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    monkeypatch.setattr(tg, "sequence_loss", stand_in)
    P = jax.sharding.PartitionSpec
    step = jax.shard_map(tg.device_step, mesh=tg.make_mesh(jax.devices()[:1]), check_vma=False,
                         in_specs=(P(), P(), P("dp"), P("dp"), P("dp"), P(), P(), P()),
                         out_specs=(P("dp"), P(), P("dp")))
    sums, loss, _ = jax.jit(step)(params, {}, jnp.ones((3, 12)), inputs, targets, tg.schedule_values(3, hp),
                                  jnp.ones(12), jnp.zeros(8, jnp.int32))
    alone = [jax.value_and_grad(one_chunk)(params, inputs[k], targets[k]) for k in range(3)]

    def magnitude(x_T, y_T):  # the stand-in's terms summed in absolute value: the scale of its fp32 rounding
        rows = {n: tg.embedding(params[n], ids) for n, ids in tg.row_ids(params, x_T).items()}
        read = {**rows, "lm_head.weight": params["lm_head.weight"][:, y_T].T}
        return sum(float(jnp.sum(jnp.abs(tg.f32(read[n]) * tg.f32(c[n])))) for n in c)

    # terms of either sign: the loss may be near zero (a draw's -0.13 missed rtol 1e-5 by 2.3e-5 absolute)
    scale = sum(magnitude(inputs[k], targets[k]) for k in range(3))
    assert abs(float(loss) - sum(float(v) for v, _ in alone)) <= 1e-7 * scale  # (seen: at most 2.2e-9 x scale)
    for n, got in sums.items():
        chunks = [np.asarray(g[n], np.float64) for _, g in alone]
        want = sum(chunks)
        assert got.shape == (1, *params[n].shape) and got.dtype == params[n].dtype, n
        assert np.any(want) == (n in c), n  # the stand-in reads those three only
        # each chunk's gradient rounded to bf16 here (the tables': by embedding's backward), the device's fp32
        # sum of the chunks rounded once there: apart by at most those roundings
        bound = 2 ** -8 * (sum(np.abs(chunk) for chunk in chunks) + np.abs(want)) + 1e-30
        assert np.all(np.abs(np.asarray(got[0], np.float64) - want) <= bound), n
    for n in ("embed.weight", "bigram_embed.weight"):
        read = np.zeros(params[n].shape[0], bool)
        for k in range(3):
            read[np.asarray(tg.row_ids(params, inputs[k])[n])] = True
        got = np.asarray(sums[n][0], np.float64)
        assert not got[~read].any() and np.all(np.abs(got[read]).sum(1) > 0), n


def test_given_the_embedding_rows_the_model_reads_nothing_else_of_their_tables(tiny_hp):
    """sequence_loss with rows (the train step's: it adds their gradients itself) leaves the token and
    bigram tables unread, so no gradient of theirs is lost (traced, not compiled)."""
    hp = tiny_hp
    w = tg.init_params(hp, 0)
    names = ("embed.weight", "bigram_embed.weight")
    x_T = jnp.zeros(128, jnp.int32)
    a = tg.schedule_values(0, hp)

    def loss(tables, rows):
        p = {**{n: v for n, v in w.items() if n not in names}, **tables}
        return tg.sequence_loss(p, x_T, x_T, a, True, tg.fp8_mlp_scales(w, 0, hp), x_T, rows=rows)[0]

    tables = {n: w[n] for n in names}
    rows = {n: w[n][i] for n, i in tg.row_ids(w, x_T).items()}
    jaxpr = jax.make_jaxpr(loss)(tables, rows).jaxpr
    table_vars = jaxpr.invars[:len(names)]
    used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    assert [id(v) in used for v in table_vars] == [False, False]
    assert all(id(v) in used for v in jaxpr.invars[len(names):])  # the rows are read
