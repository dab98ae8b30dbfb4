"""Shared test setup: the repo root on sys.path, no network for huggingface_hub, and the tiny run.

How the suite keeps its cost down (its budget, pytest <= 5 minutes on 2 cores, is met on this
machine's faster hours only: tests/README.md, "The suite's time"): compiling dominates, so every whole run of train_gpt.py
uses TINY_FLAGS (tiny_args) or the same settings in-process (tiny_hp), and every process of a test
run shares one persistent compile cache: an equal program compiles once. Add flags to a run only
where they are its point (each new --num-iterations, learning rate or device count is a new
program). On a CPU-only run XLA's LLVM works at -O1 (FAST_CPU_COMPILE).
Logs of real runs come from one shared attempt (tiny_attempt); bench.py's smoke preset is the same
shape, so its profile and suite tests load the attempt's programs.
./run.sh test runs two pytest-xdist workers; what they share is made once (shared_once): a test that
needs it late asks for it late (request.getfixturevalue), so that its worker need not wait idle."""
import dataclasses
import fcntl
import importlib.util
import json
import math
import os
import pathlib
import pkgutil
import secrets
import shutil
import subprocess
import sys
import tempfile
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def cpu_only() -> bool:
    """Whether this test run's JAX can only use the CPU (JAX_PLATFORMS=cpu, or no GPU plugin installed)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return set(platforms.split(",")) == {"cpu"}
    plugins = importlib.util.find_spec("jax_plugins")  # JAX's CUDA and ROCm plugins live there
    return plugins is None or not any(m.name.startswith(("xla_cuda", "xla_rocm"))
                                      for m in pkgutil.iter_modules(plugins.submodule_search_locations))


# XLA:CPU's LLVM at -O1 without its expensive passes: a quarter less time to compile the tiny run's programs
# (37.9 -> 27.7 s), the same val losses (all four, to the printed 4 decimals) and step times within 10%.
# Set before JAX starts (it reads XLA_FLAGS once) and inherited by every subprocess; not on GPUs.
FAST_CPU_COMPILE = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"
if cpu_only() and FAST_CPU_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_COMPILE}".strip()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def host_devices_env(devices: int) -> dict:
    """This environment for a subprocess whose JAX sees `devices` CPU devices (XLA_FLAGS appended to)."""
    return {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count="
                                       f"{devices}"}


import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The test shards' vocabulary: the synthetic text renumbered to dense token ids, its end-of-text (BOS)
# token last, so the head and the embedding tables have 2,048 rows instead of 50,304 (they cost most
# of a tiny step on a CPU).
TINY_VOCAB = 2048
TINY_BOS = TINY_VOCAB - 1

# A tiny run of train_gpt.py: the cpu preset's model (11 layers, head size 16) on chunks of 128 tokens
# (8 per step, documents cut at 128), 6 scheduled steps + 1 extension step, so every stage, the split,
# the extension, the final windows and the end of the FP8 bootstrap come by; validation every 3 steps
# on one batch. One MTP term in every stage, so one train program serves every stage: a cold start
# compiles it and the validation step (~40 s of CPU; the schedule's three MTP programs would take
# twice that); test_train lowers the three.
TINY_FLAGS = {"--preset": "cpu", "--vocab-size": TINY_VOCAB, "--bos-id": TINY_BOS, "--bigram-vocab-size": 1024,
              "--stage-batch-sizes": "1024,1024,1024,1024", "--stage-max-seq-lens": "128,128,128,128",
              "--stage-mtp-terms": "1,1,1,1",
              "--num-scheduled-iterations": 6, "--num-extension-iterations": 1, "--fp8-bootstrap-steps": 2,
              "--muon-momentum-warmup-steps": 2, "--muon-momentum-cooldown-steps": 1, "--val-tokens": 1024,
              "--val-batch-size": 1024, "--val-loss-every": 3}
TINY_STEPS = 7
TINY_VAL_STEPS = [0, 3, 6, 7]  # every 3 steps and at the end

# This test run's folder (the compile cache, the test shards, the shared attempt): made by the first
# pytest process, inherited by its xdist workers through the environment, removed by it at the end.
OWNER = "TRAIN_GPT_TEST_RUN" not in os.environ
if OWNER:
    os.environ["TRAIN_GPT_TEST_RUN"] = tempfile.mkdtemp(prefix="train_gpt-tests-")
SHARED = pathlib.Path(os.environ["TRAIN_GPT_TEST_RUN"])
COMPILE_CACHE = str(SHARED / "compile-cache")


def pytest_configure(config):
    import train_gpt

    train_gpt.enable_compile_cache(COMPILE_CACHE)  # before anything compiles: JAX reads it once
    config.addinivalue_line("markers", "heavy(rank): a test of 15 s or more (whole runs, compiles); run first, by rank")


def pytest_collection_modifyitems(items):
    """The heavy tests first, by their rank, then the others in file order. ./run.sh test's two workers
    (--dist load) get two consecutive tests each to start with (pytest-xdist's smallest first batch),
    then one at a time as they free up: the shared attempt (rank 1) and the dead-process pair (2) go to
    one worker, the whole model (3) and the two-process run (4) to the other: the pair needs the
    attempt's log when it ends, so it starts second, to end about when the attempt does instead of
    waiting for it; the bench suite (6) loads the attempt's programs, so it comes after the attempt
    is made."""
    def rank(item):  # a heavy test without a rank after the ranked ones
        heavy = item.get_closest_marker("heavy")
        return (0, heavy.args[0] if heavy.args else math.inf) if heavy else (1, 0)
    items.sort(key=rank)


def pytest_runtest_logreport(report):
    """With FAILURES_AT_ONCE=1, a failure's reason as soon as it fails, not only in the summary at the
    end, which a time limit can cut off (tests/gpu/session.sh's lane)."""
    if report.failed and os.environ.get("FAILURES_AT_ONCE") == "1":
        seed = "".join(f"\n{text}" for name, text in report.sections if name == "random inputs")
        sys.stdout.write(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-6000:]}{seed}\n")
        sys.stdout.flush()


def pytest_unconfigure(config):
    if OWNER:
        shutil.rmtree(SHARED, ignore_errors=True)


def shared_once(name: str, make) -> pathlib.Path:
    """SHARED/name, filled by make(folder) in the first process of the test run that asks; the others
    wait for it (a file lock) and reuse it."""
    folder = SHARED / name
    with open(SHARED / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / "done").touch()
    return folder


def write_tiny_shards(out):
    """Train (3 shards of 20,000 tokens) and val (8,000) shards of data/synthetic.py's text with token
    ids renumbered below TINY_VOCAB, its end-of-text token (every document's first) as TINY_BOS."""
    from data.shards import EOT, write_shard
    from data.synthetic import synthetic_tokens

    train, val = synthetic_tokens(60_000, seed=1, stream=1), synthetic_tokens(8_000, seed=1, stream=2)
    ids = np.setdiff1d(np.concatenate([train, val]), [EOT])
    assert len(ids) < TINY_BOS

    def dense(tokens):
        return np.where(tokens == EOT, TINY_BOS, np.searchsorted(ids, tokens))

    for i in range(3):
        write_shard(str(out / f"synthetic_train_{i + 1:06d}.bin"), dense(train[i * 20_000:][:20_000]))
    write_shard(str(out / "synthetic_val_000000.bin"), dense(val))


@pytest.fixture(autouse=True)
def _backend_variables_restored():
    """train_gpt.main and bench.main run in-process set XLA's start-up variables (backend_defaults) after
    this worker's backend started, where XLA no longer reads them; XLA_FLAGS would still reach later
    tests' compile-cache keys (JAX hashes it), so each test leaves both as it found them."""
    names = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    saved = {name: os.environ.get(name) for name in names}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# Every run draws fresh random inputs, and a failure can draw them again: np.random.default_rng() without
# a seed (how the tests draw theirs) starts from this test's seed, taken from the OS or from TEST_SEED,
# which a failed test's report shows (a rare failure of a bound was not reproducible: CI, 2026-11-28).
# Draws at import time and in subprocesses keep their own seeds.
@pytest.fixture(autouse=True)
def _test_seed(request, monkeypatch):
    seed = int(os.environ.get("TEST_SEED") or secrets.randbits(32))
    request.node.test_seed, seeds, default_rng = seed, np.random.SeedSequence(seed), np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng",
                        lambda seed=None: default_rng(seeds.spawn(1)[0] if seed is None else seed))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and hasattr(item, "test_seed"):
        report.sections.append(("random inputs", f"seed {item.test_seed}: TEST_SEED={item.test_seed} python -m "
                                                 f"pytest '{item.nodeid}' draws them again"))
    return report


@pytest.fixture(scope="session")
def synthetic_shards():
    """The tiny shards (write_tiny_shards), as flags for train_gpt.py."""
    out = shared_once("shards", write_tiny_shards)
    return {"--train-files": str(out / "synthetic_train_*.bin"), "--val-files": str(out / "synthetic_val_*.bin")}


@pytest.fixture(scope="session")
def tiny_args(synthetic_shards):
    """tiny_args(records, **overrides) -> argv for train_gpt.py."""
    def make(records, **overrides):
        args = {**TINY_FLAGS, "--compile-cache-dir": COMPILE_CACHE, "--records-dir": records, **synthetic_shards,
                **overrides}
        return [str(x) for kv in args.items() for x in kv]
    return make


@pytest.fixture(scope="session")
def tiny_attempt(tiny_args):
    """One real record attempt at the tiny settings, shared by the tests that need logs of real runs
    (test_attempt, test_records, test_train): `records/attempt.py --runs 2 --seed 0`, two runs of
    train_gpt.py with seeds 0 and 1 (the second finds the first's program in the compile cache), each
    with --save-weights to one file (the second run's weights replace the first's). Returns its records
    folder, the finished process (returncode, stdout, stderr), {seed: log path} and the weights file."""
    from records.logs import parse_log

    def run(folder):
        script_args = tiny_args(folder / "records", **{"--save-weights": folder / "weights.npz"})
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "records", "attempt.py"), "--runs", "2", "--seed",
                               "0", *script_args], cwd=ROOT, capture_output=True, text=True, timeout=900)
        (folder / "proc.json").write_text(json.dumps(dict(returncode=proc.returncode, stdout=proc.stdout,
                                                          stderr=proc.stderr)))

    folder = shared_once("tiny_attempt", run)
    proc = types.SimpleNamespace(**json.loads((folder / "proc.json").read_text()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = folder / "records"
    logs = {parse_log(str(p)).hyperparameters["seed"]: str(p) for p in records.glob("*.txt")}
    return types.SimpleNamespace(records=records, proc=proc, logs=logs, weights=folder / "weights.npz")


@pytest.fixture
def tiny_hp(tiny_args, tmp_path):
    """The Hyperparameters of tiny_args, for train_gpt's functions in this process."""
    import train_gpt as tg

    args, overrides = tg.parse_args(tiny_args(tmp_path / "records"))
    return tg.with_stage_flags(dataclasses.replace(tg.PRESETS[args.preset], **overrides), args)


@pytest.fixture
def run_train():
    """run_train(argv, **subprocess_kwargs): train_gpt.py in a subprocess, output captured."""
    def run(args, **kwargs):
        return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py"), *args], capture_output=True,
                              text=True, timeout=900, cwd=ROOT, **kwargs)
    return run
