"""§7 Whole runs of train_gpt.py: the record log, bad input, exit codes, interrupts, a bug's traceback,
and --save-weights / --init-weights. Device-count invariance is in test_distributed."""
import dataclasses
import glob
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import train_gpt as tg
from conftest import TINY_STEPS, TINY_VAL_STEPS, TINY_VOCAB, host_devices_env
from data.shards import write_shard
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_tiny_run_writes_a_log_that_parses_back(tiny_attempt):
    """The first run of conftest's tiny attempt: train_gpt.py with the tiny flags and --seed 0."""
    log = parse_log(tiny_attempt.logs[0])
    with open(os.path.join(ROOT, "train_gpt.py")) as f:
        assert log.source == f.read()
    assert log.status == "complete" and log.preset == "cpu"
    assert log.num_iterations == TINY_STEPS and log.hyperparameters["num_extension_iterations"] == 1
    assert [s for s, *_ in log.val_curve] == TINY_VAL_STEPS
    assert [s for s, *_ in log.train_steps] == list(range(1, TINY_STEPS + 1))
    assert log.val_curve[0][1] == pytest.approx(np.log(TINY_VOCAB), abs=0.01)  # near-uniform at init
    assert log.val_curve[-1][1] < log.val_curve[0][1] - 0.3  # the synthetic text is learnable
    assert log.summary["final_val_loss"] == pytest.approx(log.val_curve[-1][1], abs=1e-4)
    assert f"step:{TINY_STEPS}/{TINY_STEPS} val_loss:{log.val_curve[-1][1]:.4f}" in tiny_attempt.proc.stdout
    # the console's last word on the run: where its log is, and that synthetic shards' losses mean nothing
    ending = tiny_attempt.proc.stdout.split("\nrun complete\n")[1].splitlines()[0]
    assert ending.startswith(f"the record log: {tiny_attempt.logs[0]} ")
    assert ending.endswith("trained on synthetic shards: the losses say nothing about FineWeb")
    text = open(tiny_attempt.logs[0]).read()
    assert "stages at [0, 2, 4, 6], batch [1024, 1024, 1024, 1024] tokens as 8 chunks" in text
    assert "compile: " in text and "for 1 train program and the validation step" in text  # --stage-mtp-terms 1,1,1,1


def train_step_args(hp, w):
    """make_train_step's arguments at step 0 for weights w, the batches as shapes of 8 chunks of 128."""
    params = tg.trainable(w, hp)
    batch = tg.jax.ShapeDtypeStruct((tg.RANKS, 128), tg.jnp.int32)
    opt_state = tg.init_optimizer_state(params, hp, tg.make_mesh().size)
    return (params, {k: w[k] for k in tg.buffer_shapes(hp)}, opt_state, tg.fp8_state(w),
            batch, batch, *tg.step_inputs(0, hp), tg.jnp.asarray(tg.prefix_table(hp.padded_vocab)))


def test_the_schedules_mtp_lengths_make_a_train_program_each_that_traces(tiny_hp):
    """Without --stage-mtp-terms the tiny schedule keeps the record's 3, 2, 1, 1 MTP terms: a train
    program per MTP length (the tiny runs compile only the one-term program), each traced as
    lower_steps traces it (not lowered: the tiny runs lower theirs; not compiled: ~80 s of CPU), and
    takes that many MTP weights."""
    hp = dataclasses.replace(tiny_hp, stages=tuple(
        tg.dataclasses.replace(s, mtp_start=full.mtp_start, mtp_end=full.mtp_end)
        for s, full in zip(tiny_hp.stages, tg.PRESETS["cpu"].stages)))
    params, buffers, opt_state, fp8, *_, prefix_V = train_step_args(hp, tg.init_params(hp, 0))
    mesh = tg.make_mesh()
    train_step = tg.make_train_step(hp, mesh)
    programs = {tg.stage_shape(first, hp): tg.trace_train_step(hp, mesh, first, params, buffers, opt_state, fp8,
                                                               prefix_V, train_step) for first in tg.program_steps(hp)}
    assert list(programs) == [(128, 3), (128, 2), (128, 1)]  # chunk tokens, MTP terms
    for (_, mtp), traced in programs.items():
        a = traced.args_info[0][6]  # train_step(params, buffers, opt_state, fp8, x, y, a, ...): a's weights
        assert a["mtp"].shape == (mtp,)
    # the XLA attention's loops count a static number of diagonals: no loop of a runtime trip count,
    # which a GPU would test on the host every iteration (20 of them per chunk in this program)
    jaxpr = str(programs[128, 3].jaxpr)
    assert "while[" not in jaxpr and jaxpr.count("scan[") >= 20
    assert hp.mlp == "xla" and "mlp_up" not in jaxpr and "mlp_dpre" not in jaxpr  # --mlp pallas: the test below


@pytest.mark.parametrize("dc", ["pallas", "xla"])
def test_the_pallas_kernels_are_in_the_train_program(tiny_hp, dc):
    """--mlp pallas reaches each layer's FP8 MLP in the train step: 11 up-projection kernels in the
    forward and 11 dpre kernels in the backward; --head pallas the head's two passes, once a chunk;
    --attention pallas the attention's three kernels twice (the layers share one jitted call per shape: the
    paired layers' doubled sequence, the others'); --dc pallas layer 10's DC correction's three once, and
    --dc xla none, whatever --attention; the validation program the forward kernels of both (traced, not
    compiled; all xla: the test above)."""
    args = train_step_args(tiny_hp, tg.init_params(tiny_hp, 0))
    hp = dataclasses.replace(tiny_hp, mlp="pallas", head="pallas", attention="pallas", dc=dc)
    mesh = tg.make_mesh()
    jaxpr = str(tg.make_train_step(hp, mesh).trace(*args).jaxpr)

    def calls(jaxpr, name):  # each kernel is in the text twice: Triton for CUDA, interpreted elsewhere; the first
        return len(re.findall(rf"interpret=False\s+jaxpr={name}\d*\s", jaxpr))

    for name, count in (("mlp_up", tg.NUM_LAYERS), ("mlp_dpre", tg.NUM_LAYERS), ("head_softcap", 1), ("head_grad", 1),
                        ("attention_fwd", 2), ("attention_dq", 2), ("attention_dkv", 2),
                        *((name, int(dc == "pallas")) for name in ("dc_fwd", "dc_dq", "dc_dkv"))):
        assert calls(jaxpr, name) == count, name
    val_batch = tg.jax.ShapeDtypeStruct((tg.RANKS, hp.val_batch_size // tg.RANKS), tg.jnp.int32)
    a = {k: v for k, v in tg.schedule_values(0, hp).items() if k in tg.VAL_KEYS}
    val_jaxpr = str(tg.make_val_step(hp, mesh).trace(args[0], args[1], val_batch, val_batch, a).jaxpr)
    for name, count in (("attention_fwd", 2), ("dc_fwd", int(dc == "pallas")), ("attention_dq", 0), ("dc_dq", 0)):
        assert calls(val_jaxpr, name) == count, name


def test_compile_steps_compiles_every_program_at_once_and_keeps_each_by_its_shape(monkeypatch):
    """With stand-in lowered programs whose compile() returns only when all are compiling (a barrier):
    they run at once, and each compiled program comes back under its own stage shape although they
    finish in reverse order."""
    shapes = [(16384, 3), (32768, 2), (49152, 1)]
    all_at_once, finished = tg.threading.Barrier(len(shapes) + 1, timeout=30), []

    class Lowered:
        def __init__(self, name, delay):
            self.name, self.delay = name, delay

        def compile(self):
            all_at_once.wait()  # broken (an error) unless the 4 compiles are running together
            tg.time.sleep(self.delay)
            finished.append(self.name)
            return f"compiled {self.name}"

    programs = {shape: Lowered(shape, 0.1 * (len(shapes) - i)) for i, shape in enumerate(shapes)}
    monkeypatch.setattr(tg, "lower_steps", lambda *args: (programs, Lowered("val", 0)))
    compiled, val, loaded = tg.compile_steps(*[None] * 7)
    assert compiled == {shape: f"compiled {shape}" for shape in shapes} and val == "compiled val" and loaded == 0
    assert finished == ["val", *reversed(shapes)]


def test_an_interrupt_while_compiling_goes_on_without_waiting_for_the_compiles(monkeypatch):
    """A signal handler's exception (train()'s Interrupted, here KeyboardInterrupt) raised while the
    stand-in compiles still run leaves compile_steps at once; they end later, on their own."""
    release, finished = tg.threading.Event(), []

    class Lowered:
        def compile(self):
            finished.append(release.wait(timeout=30))  # True: released by the test, after the interrupt
            return "compiled"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(tg, "lower_steps", lambda *args: ({(128, 1): Lowered()}, Lowered()))
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            tg.compile_steps(*[None] * 7)
        assert finished == []  # the compiles were still running when compile_steps gave up
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release.set()
    for _ in range(100):
        if len(finished) < 2:
            tg.time.sleep(0.05)
    assert finished == [True, True]


def test_cache_hits_count_the_programs_loaded_from_the_persistent_cache():
    """The compile line's "N of M loaded from it" (and bench.py's): JAX's cache-hit events, counted only
    inside the block, from the compile threads too. conftest enabled the test run's persistent cache."""
    salt = float(np.random.default_rng().integers(1, 2**30))  # a program no earlier run has cached

    def compile_it(_=None):  # a new function each time, so JAX's in-memory caches do not answer; no eager op
        return tg.jax.jit(lambda x: tg.jnp.sin(x) * salt).lower(tg.jax.ShapeDtypeStruct((8,), tg.F32)).compile()

    with tg.CacheHits() as cold:
        compile_it()
    with tg.CacheHits() as warm:
        list(tg.ThreadPoolExecutor(2).map(compile_it, range(2)))
    compile_it()  # after the block: not counted
    assert (cold.count, warm.count) == (0, 2)


def test_the_compile_cache_keeps_xlas_autotuning_results_and_kernels():
    """The XLA options every program of this process compiles with (conftest enabled the test run's cache
    through enable_compile_cache): GPU autotuning results and XLA's kernel cache, both in the cache folder
    (the kernel cache is off by JAX's default; it saves a changed program's unchanged kernels: README).
    Read through JAX's own get_compile_options, which sets them from its config."""
    from jax._src import compiler  # (no public API shows a program's debug options before it compiles)

    # each object held in a name: the parts read from a temporary dangle (a segfault)
    compile_options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    build_options = compile_options.executable_build_options
    options = build_options.debug_options
    cache = tg.jax.config.jax_compilation_cache_dir
    assert cache and options.xla_gpu_per_fusion_autotune_cache_dir.startswith(cache)
    assert options.xla_gpu_kernel_cache_file.startswith(cache)


@pytest.mark.parametrize("case", ["no_shards", "bad_magic", "truncated", "short_val", "too_many_steps",
                                  "records_dir", "vocab", "init_weights", "save_weights", "val_among_train"])
def test_bad_input_fails_before_writing_anything(case, tiny_args, synthetic_shards, tmp_path, capsys):
    """In this process through main(): these fail before anything compiles (the 3-device case below
    shows the same exit code 2 from a process of its own)."""
    records = tmp_path / "records"
    overrides, expect = {}, ""
    bad = tmp_path / "bad_000001.bin"
    if case == "no_shards":
        overrides, expect = {"--train-files": str(tmp_path / "nothing_*.bin")}, "cached_fineweb10B.py"
    elif case in ("bad_magic", "truncated"):
        write_shard(str(bad), np.arange(100_000) % 2000)
        data = bytearray(bad.read_bytes())
        if case == "bad_magic":
            data[0] ^= 0xFF
        bad.write_bytes(bytes(data[:-2]) if case == "truncated" else bytes(data))
        overrides, expect = {"--train-files": str(bad)}, "bad_000001.bin"
        if case == "bad_magic":  # perhaps no shard at all (a pattern too wide): the fix says both ways
            expect = (f"{bad} is not a version-1 token shard (magic {int.from_bytes(data[:4], 'little', signed=True)}, "
                      f"version 1; expected 20240520, 1): if it is a shard, delete it")
    elif case == "short_val":
        overrides, expect = {"--val-tokens": 1024 * 1024}, "--val-tokens"
    elif case == "too_many_steps":  # 60,000 train tokens hold about 50 steps of 1,024
        overrides, expect = {"--num-scheduled-iterations": 500}, "the train shards ran out at step"
    elif case == "vocab":  # the boundary: a token id equal to --vocab-size, in a shard the run reads
        for i, path in enumerate(sorted(glob.glob(synthetic_shards["--train-files"]))):  # the first made bad
            tokens = np.array(tg.open_shard(path))
            if i == 0:
                tokens[len(tokens) // 2] = TINY_VOCAB
            write_shard(str(tmp_path / f"bad_{i + 1:06d}.bin"), tokens)
        overrides = {"--train-files": str(tmp_path / "bad_*.bin")}
        expect = f"bad_000001.bin holds token id {TINY_VOCAB}, but --vocab-size is {TINY_VOCAB}"
    elif case == "records_dir":
        (tmp_path / "a_file").write_text("")
        overrides, expect = {"--records-dir": str(tmp_path / "a_file" / "records")}, "a_file is a file, not a folder"
    elif case == "init_weights":
        overrides, expect = {"--init-weights": str(tmp_path / "nothing.npz")}, "nothing.npz"
    elif case == "save_weights":
        overrides, expect = {"--save-weights": str(tmp_path)}, "is a folder"
    elif case == "val_among_train":  # a pattern that also matches the val shard: training on validation data
        folder = os.path.dirname(synthetic_shards["--train-files"])
        overrides = {"--train-files": os.path.join(folder, "synthetic_*.bin")}
        expect = "synthetic_val_000000.bin matches both --train-files"
    assert tg.main(tiny_args(records, **overrides)) == 2
    err = capsys.readouterr().err
    assert expect in err and err.startswith("error: ") and "Traceback" not in err, err[-2000:]
    assert case != "bad_magic" or err.rstrip().endswith("if not, make --train-files / --val-files match shards only")
    assert not records.exists() or not any(records.iterdir())


def test_token_ids_are_checked_in_the_shards_the_run_reads(tiny_hp, tmp_path):
    """A token id past the vocabulary stops the run where its steps would read it (an embedding lookup past
    the table would clamp silently), and not in a shard that matches --train-files but lies past the run's
    last step (FineWeb's 103 shards are 20 GB, the record reads 5)."""
    rng = np.random.default_rng()
    good = rng.integers(0, TINY_VOCAB - 1, 30_000)
    good[::rng.integers(50, 120)] = tiny_hp.bos_id  # documents: 7 steps of 8 x 129 tokens take at most 168 of them
    bad = good.copy()
    bad[rng.integers(bad.size)] = TINY_VOCAB  # one id past the table
    write_shard(str(tmp_path / "val_000000.bin"), good[:2048])
    mesh = tg.make_mesh(jax.devices()[:1])
    for first, second, refused in [(good, bad, False), (bad, good, True)]:
        write_shard(str(tmp_path / "train_000001.bin"), first)
        write_shard(str(tmp_path / "train_000002.bin"), second)
        hp = dataclasses.replace(tiny_hp, train_files=str(tmp_path / "train_*.bin"),
                                 val_files=str(tmp_path / "val_*.bin"), records_dir=str(tmp_path / "records"))
        if refused:
            with pytest.raises(tg.DataError, match=f"train_000001.bin holds token id {TINY_VOCAB}, but --vocab-size"):
                tg.check_inputs(hp, mesh)
        else:
            assert tg.check_inputs(hp, mesh).train_files[-1].endswith("train_000002.bin")


def test_a_run_checks_its_output_folders_too(tiny_hp, tmp_path):
    """A run's own checks (check_inputs: run.sh's --check may be skipped) refuse an empty --records-dir
    and a --save-weights that is a folder, and make the folders they will write."""
    mesh = tg.make_mesh(jax.devices()[:1])
    with pytest.raises(tg.ConfigError, match="--records-dir is empty"):
        tg.check_inputs(dataclasses.replace(tiny_hp, records_dir=""), mesh)
    with pytest.raises(tg.ConfigError, match="is a folder: give a file name"):
        tg.check_inputs(tiny_hp, mesh, save_path=str(tmp_path))
    tg.check_inputs(tiny_hp, mesh, save_path=str(tmp_path / "w" / "w.npz"))
    assert (tmp_path / "records").is_dir() and (tmp_path / "w").is_dir()


def test_check_refuses_output_folders_that_cannot_be_written_and_makes_none(tiny_args, tmp_path, capsys,
                                                                           monkeypatch):
    """--check (run.sh's before any data work) looks at --records-dir, --save-weights' folder and
    --compile-cache-dir as a run would write them, without making them."""
    (tmp_path / "a_file").write_text("kept")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")

    def check(**overrides):
        return tg.main([*tiny_args(tmp_path / "records", **overrides), "--check"]), capsys.readouterr().err

    for overrides, expect in [({"--records-dir": tmp_path / "a_file"}, "a_file is a file, not a folder"),
                              ({"--records-dir": tmp_path / "a_file" / "logs"}, "a_file is a file, not a folder"),
                              ({"--records-dir": tmp_path / "gone" / "logs"}, "gone is a broken link"),
                              ({"--records-dir": ""}, "--records-dir is empty"),
                              ({"--save-weights": tmp_path / "a_file" / "w.npz"}, "a_file is a file, not a folder"),
                              ({"--save-weights": tmp_path}, "is a folder: give a file name"),
                              ({"--save-weights": f"{tmp_path / 'out'}/"}, "is a folder: give a file name"),
                              ({"--compile-cache-dir": tmp_path / "a_file"}, "--compile-cache-dir folder")]:
        code, err = check(**overrides)
        assert code == 2 and err.startswith("error: ") and expect in err, (overrides, err)
    new = tmp_path / "new" / "records"
    assert tg.main([*tiny_args(new, **{"--save-weights": tmp_path / "new" / "w" / "w.npz",
                                       "--compile-cache-dir": tmp_path / "new" / "cache"}), "--check"]) == 0
    assert not (tmp_path / "new").exists() and (tmp_path / "a_file").read_text() == "kept"
    monkeypatch.setattr(tg.os, "access", lambda path, mode: False)  # (tests may run as root, who writes anywhere)
    code, err = check()
    assert code == 2 and f"{tmp_path} is not writable" in err, err


def test_a_device_count_that_does_not_split_the_8_chunks(tiny_args, run_train, tmp_path):
    result = run_train(tiny_args(tmp_path / "records"), env=host_devices_env(3))
    assert result.returncode == 2 and "3 devices: the step's 8 chunks must split evenly" in result.stderr, \
        result.stderr[-2000:]


def test_backend_defaults_give_the_gpu_pool_90_percent_and_xla_cublas_gemms_unless_the_user_says_otherwise():
    env = {"OTHER": "1"}
    tg.backend_defaults(env)  # JAX's default 75% left one H100 no room for the last stage (2026-11-27)
    assert env == {"OTHER": "1", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90",
                   "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6", "XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    tg.backend_defaults(env)  # the user's flags kept, ours added
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6",
                   "XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_gpu_enable_triton_gemm=false"}
    for given in ("--xla_gpu_enable_triton_gemm=true", "--xla_gpu_enable_triton_gemm"):
        env = {"XLA_FLAGS": given}
        tg.backend_defaults(env)  # named by the user: theirs
        assert env["XLA_FLAGS"] == given
    env = {"XLA_FLAGS": "/home/me/xla_flags.txt"}  # XLA reads a value without a leading '-' as a file of flags
    tg.backend_defaults(env)
    assert env["XLA_FLAGS"] == "/home/me/xla_flags.txt"


def test_xla_gemms_are_cublas_where_xla_flags_turn_tritons_off_last():
    """The FP8 head's bf16 pattern is cuBLASLt's (train_gpt._fp8_logits); XLA's Triton GEMMs, on unless named
    off, would run it as a bf16 GEMM."""
    env = {}
    tg.backend_defaults(env)
    assert tg.xla_gemms_are_cublas(env)
    for flags, cublas in (("", False), ("--xla_dump_to=/tmp/d", False), ("--xla_gpu_enable_triton_gemm=0", True),
                          ("--xla_gpu_enable_triton_gemm=true", False), ("--xla_gpu_enable_triton_gemm", False),
                          ("--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_triton_gemm", False),
                          ("--xla_gpu_enable_triton_gemm=true --xla_gpu_enable_triton_gemm=False", True),
                          ("--xla_gpu_enable_triton_gemm_any=false", False), ("/home/me/xla_flags.txt", False)):
        assert tg.xla_gemms_are_cublas({"XLA_FLAGS": flags}) == cublas, flags


def test_the_eta_prices_the_steps_left_by_their_tokens():
    """A later stage's step holds more tokens, so it takes longer than the steps timed so far."""
    tokens_S = np.array([100, 100, 200, 200, 300, 300], np.float64)
    # 2 steps of 100 tokens in 2,000 ms: 10 ms a token, so 1,000 tokens left = 10 s; a validation 30 s
    assert tg.eta_note(tokens_S, 2, 2000.0, 1, 30.0) == f"  (ETA {40 / 60:.1f} min)"  # per step: 34 s, 0.6
    assert tg.eta_note(tokens_S, 6, 9000.0, 0, 0.0) == ""  # nothing left


def test_validations_before_the_last_read_the_first_intermediate_val_tokens(tiny_hp):
    """run_steps with stand-in programs: each validation's batches and losses as they were read."""
    hp = dataclasses.replace(tiny_hp, val_tokens=4 * 1024, intermediate_val_tokens=1024, val_loss_every=3)
    val_batches = [(np.full(1, k), None) for k in range(4)]
    read, lines = [], []

    def val_step(params, buffers, x, y, a):
        read[-1].append(int(x[0]))
        return tg.jnp.asarray(float(x[0]))  # batch k's loss is k

    def train_step(params, buffers, opt_state, fp8, x, y, a, sv, bootstrap, prefix_V):
        read.append([])
        return params, opt_state, fp8, tg.jnp.asarray(1.0)

    programs = {tg.stage_shape(step, hp): train_step for step in range(hp.total_steps)}
    read.append([])
    tg.run_steps(hp, lambda line, note="": lines.append(line), lambda text: None, programs, val_step,
                 (None, None, None, None), iter([(None, None)] * hp.total_steps), val_batches, None)
    val_reads = {step: r for step, r in enumerate(read) if r}
    assert val_reads == {0: [0], 3: [0], 6: [0], hp.total_steps: [0, 1, 2, 3]}
    assert [line.split()[1] for line in lines if "val_loss" in line][-1] == "val_loss:1.5000"  # mean of 0..3
    for bad in (512, 3 * 1024 // 2, 5 * 1024):  # not a multiple of --val-batch-size, more than --val-tokens
        with pytest.raises(tg.ConfigError, match="--intermediate-val-tokens"):
            tg.dataclasses.replace(hp, intermediate_val_tokens=bad)


def test_a_signal_during_training_ends_the_run_between_steps(tiny_hp):
    """train()'s handler only notes a signal once the data thread runs (an exception raised inside JAX's
    own code could leave a lock held that the thread waits for); run_steps stops before the next step,
    the step it was at on the Interrupted."""
    stop, dispatched = tg.StopRequests(), []

    def train_step(params, buffers, opt_state, fp8, x, y, a, sv, bootstrap, prefix_V):
        dispatched.append(len(dispatched))
        if len(dispatched) == 2:
            stop.signals.append("SIGTERM")  # as if it came while step 2 ran
        return params, opt_state, fp8, tg.jnp.asarray(1.0)

    programs = {tg.stage_shape(step, tiny_hp): train_step for step in range(tiny_hp.total_steps)}
    with pytest.raises(tg.Interrupted, match="SIGTERM") as e:
        tg.run_steps(tiny_hp, lambda line, note="": None, lambda text: None, programs,
                     lambda *args: tg.jnp.asarray(2.0), (None, None, None, None),
                     iter([(None, None)] * tiny_hp.total_steps), [(None, None)], None, stop)
    assert dispatched == [0, 1] and e.value.step == 2


class Board:
    """JAX's coordination-service key-value store, as StopRequests uses it, for processes simulated in one."""
    def __init__(self):
        self.posts = {}

    def key_value_set(self, key, value):
        assert key not in self.posts, key  # (JAX refuses to overwrite)
        self.posts[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.posts.items() if k.startswith(prefix)]


def test_processes_stop_before_the_first_step_a_post_names(monkeypatch):
    """StopRequests with 2 processes (simulated: one board, process_index switched): process 1 sees a signal
    at step 5 and posts 7; neither stops before 7, both at 7, whatever else is posted later; a process whose
    signal came before training posts 0, so the others stop before their first step."""
    board, me = Board(), [0]
    monkeypatch.setattr(tg.jax, "process_count", lambda: 2)
    monkeypatch.setattr(tg.jax, "process_index", lambda: me[0])
    monkeypatch.setattr(tg.StopRequests, "_board", staticmethod(lambda: board))

    def ask(stop, process, step):
        me[0] = process
        return stop.at(step)

    zero, one = tg.StopRequests(), tg.StopRequests()
    assert [ask(zero, 0, 4), ask(one, 1, 4)] == [None, None]
    one.signals.append("SIGINT")
    assert [ask(one, 1, 5), ask(zero, 0, 5), ask(zero, 0, 6), ask(one, 1, 6)] == [None] * 4
    zero.signals.append("SIGTERM")  # a later signal, posted for step 9: the first post still decides
    assert [ask(zero, 0, 7), ask(one, 1, 7)] == ["SIGINT", "SIGINT"]
    assert board.posts == {"train_gpt/stop/1": "7 SIGINT", "train_gpt/stop/0": "9 SIGTERM"}
    board, me[0] = Board(), 1
    tg.StopRequests().stopped_before_training("SIGTERM")
    assert ask(tg.StopRequests(), 0, 0) == "SIGTERM"


class Faulted:
    """A loss whose reading fails, as a device fault surfaces at the next wait."""
    def addressable_data(self, i):
        raise RuntimeError("INTERNAL: CUDA error: CUDA_ERROR_ILLEGAL_INSTRUCTION")


def test_a_device_error_names_what_was_on_the_devices(tiny_hp):
    """The fault of step 1's program surfaces when its loss is read, step 2 already dispatched: the error
    names both, and which ran its program for the first time; one in a validation names it."""
    assert tg.program_steps(tiny_hp) == [0] and tiny_hp.val_loss_every == 3
    losses = iter([Faulted()])

    def train_step(params, buffers, opt_state, fp8, x, y, a, sv, bootstrap, prefix_V):
        return params, opt_state, fp8, next(losses, tg.jnp.asarray(1.0))

    def val_step(params, buffers, x, y, a):
        return tg.jnp.asarray(2.0)

    def run(val_step):
        programs = {tg.stage_shape(step, tiny_hp): train_step for step in range(tiny_hp.total_steps)}
        with pytest.raises(RuntimeError, match="CUDA_ERROR_ILLEGAL_INSTRUCTION") as e:
            tg.run_steps(tiny_hp, lambda line, note="": None, lambda text: None, programs, val_step,
                         (None, None, None, None), iter([(None, None)] * tiny_hp.total_steps),
                         [(None, None)], None)
        return e.value.__notes__

    assert run(val_step) == ["on the devices when it failed: step 1 (stage 0, its program run for the first "
                             "time) and step 2 (stage 0)"]
    reads = iter([tg.jnp.asarray(2.0), Faulted()])  # step 0's validation reads, step 3's fails
    assert run(lambda *args: next(reads)) == ["on the devices when it failed: the validation at step 3"]
    # the log's line: one line, with run_steps' note but not the multi-line notes JAX adds to errors
    e = RuntimeError("INTERNAL: CUDA error\nmore")
    e.add_note("--------------------\nFor simplicity, JAX has removed its internal frames")
    e.add_note("on the devices when it failed: step 9 (stage 0)")
    assert tg.stopped_line(e) == "stopped: RuntimeError: INTERNAL: CUDA error (on the devices when it failed: step 9 " \
                                 "(stage 0))"


def test_non_finite_loss_stops_and_closes_the_log(tiny_args, tiny_hp, run_train, tmp_path):
    """Weights whose FP8 activation scales are NaN (used in training only): validation at step 0 is
    finite, the first train step's loss is not. The tiny run's programs serve (no new compile)."""
    records = tmp_path / "records"
    weights = tg.init_params(tiny_hp, 0)
    weights["_mlp_down_act_scales"] = weights["_mlp_down_act_scales"] * np.nan
    tg.save_weights(weights, str(tmp_path / "nan_scales.npz"))
    result = run_train(tiny_args(records, **{"--init-weights": tmp_path / "nan_scales.npz"}))
    assert result.returncode == 1, result.stderr[-2000:]
    (log_path,) = records.iterdir()
    *_, before, last = log_path.read_text().rstrip().splitlines()
    assert last.startswith("stopped: non-finite train loss") and "learning rate" in last
    # numbered as the step lines are: the line before is the last step that finished with a finite loss
    stopped_at = int(re.search(r"at step (\d+)", last).group(1))
    assert before.startswith(f"step:{stopped_at - 1}/") or (stopped_at == 1 and "val_loss" in before), (before, last)


@pytest.mark.parametrize("signum, console_gone", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_signal_ends_the_log_with_interrupted(signum, console_gone, tiny_args, tmp_path):
    """console_gone: the run's stdout a pipe whose reader is gone first, as `train_gpt.py | tee` after a Ctrl-C
    (tee dies of it too): the record still gets its last lines, and nothing is a traceback."""
    records = tmp_path / "records"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train_gpt.py"),
                             *tiny_args(records)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        for line in proc.stdout:  # wait until training runs (7 steps, ~4 s, before the end)
            if line.startswith("step:1/"):
                break
        if console_gone:
            proc.stdout.close()  # the run's next line meets a broken pipe
            proc.stdout = None  # (communicate then reads stderr only)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)  # reads the pipes: a full pipe cannot block the run's exit
        assert proc.returncode == 128 + signum, (out or "")[-2000:] + err[-2000:]
        assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
    finally:
        proc.kill()
    (log_path,) = records.iterdir()
    *_, before, last = log_path.read_text().rstrip().splitlines()
    assert last.startswith("interrupted at step ") and signal.Signals(signum).name in last
    # numbered as the step lines are: the line before is that step's (the one on the devices ends first)
    interrupted_at = re.search(r"at step (\d+)", last).group(1)
    assert before.startswith(f"step:{interrupted_at}/"), (before, last)


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


def test_an_interrupt_that_c_code_wrapped_in_its_own_error_is_still_an_interrupt(monkeypatch, tiny_args, tmp_path,
                                                                                   capsys):
    """The handler's Interrupted raised inside a callback from C code comes out as that code's error, caused by
    it (jax 0.11.2 under load, 2 Ctrl-Cs in 40: numpy's SystemError while tracing): still exit 130, no log, no
    traceback; so is an error raised while the interrupt was being handled, not a bug's."""
    def wrapped(*args, **kwargs):
        try:
            raise tg.Interrupted("SIGINT")
        except tg.Interrupted as e:
            raise SystemError("<function _ScalarMeta.__numpy_dtype__> returned a result with an exception set") from e

    monkeypatch.setattr(tg, "lower_steps", wrapped)
    assert tg.main(tiny_args(tmp_path / "r")) == 130
    assert "interrupted (SIGINT) before training started; no record log was written" in capsys.readouterr().out
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())
    try:
        try:
            raise tg.Interrupted("SIGTERM")
        except tg.Interrupted:
            raise OSError("while cleaning up")  # context, not cause: still the interrupt's consequence
    except OSError as e:
        assert str(tg.interruption(e)) == "SIGTERM"
    assert tg.interruption(ValueError("a bug")) is None


def test_an_interrupt_that_a_callback_swallowed_still_stops_the_run_before_its_log(monkeypatch, tiny_args, tmp_path,
                                                                                     capsys):
    """The handler's Interrupted raised inside a callback whose caller only prints it (a gc callback of jax's,
    under load: Python's "Exception ignored in" and a traceback, and the compile went on) is lost; the run,
    told by the signal itself, stops once the compiles are done: exit 130, no log, no traceback (it had
    trained to the end)."""
    class Dropped:
        def __del__(self):  # an exception here goes to sys.unraisablehook, as a gc callback's does
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs meanwhile and raises

    def compile_steps(*args, **kwargs):
        Dropped()
        return None, None, 0  # never used

    monkeypatch.setattr(tg, "compile_steps", compile_steps)
    assert tg.main(tiny_args(tmp_path / "r")) == 130
    out, err = capsys.readouterr()
    assert "interrupted (SIGINT) before training started; no record log was written" in out
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_a_bug_is_not_reported_as_bad_input(monkeypatch, tiny_args, tmp_path):
    """Only the project's own input errors exit 2; a ValueError from the code keeps its traceback."""
    def planted(*args, **kwargs):
        raise ValueError("planted bug")

    monkeypatch.setattr(tg, "compile_steps", planted)
    with pytest.raises(ValueError, match="planted bug"):
        tg.main(tiny_args(tmp_path / "r"))
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())


def test_saved_weights_continue_the_run_where_it_ended(tiny_attempt, tiny_hp):
    """--save-weights writes ref89's format (conftest's tiny attempt gives it to both its runs: the
    file holds the last run's, seed 1's); --init-weights from it starts where that run ended: its
    step-0 validation is the run's last but for the attention's YaRN state (step 0's, not the
    extension's; the tiny batches are shorter than every window, so the windows change nothing)."""
    saved = np.load(tiny_attempt.weights)
    assert set(saved.files) == set(tg.param_shapes(tiny_hp)) | set(tg.buffer_shapes(tiny_hp))
    init = tg.init_params(tiny_hp, 1)
    assert not np.array_equal(saved["mlp_bank"], np.asarray(init["mlp_bank"], np.float32))  # trained
    assert f"weights saved: {tiny_attempt.weights}" in tiny_attempt.proc.stdout
    last = parse_log(tiny_attempt.logs[1]).final_val_loss
    second = tg.train(tiny_hp, "cpu", tg.make_mesh(), init_path=str(tiny_attempt.weights))
    start = parse_log(second["log"]).val_curve[0][1]
    assert start == pytest.approx(last, abs=1e-3)  # measured: 1e-4 apart (seed 0's run ended 5e-3 away)
    assert start < np.log(TINY_VOCAB) - 0.3
