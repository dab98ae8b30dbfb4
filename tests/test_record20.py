"""The record-20 archive (records/record20/train_gpt.py), loaded by path under another module name:
a tiny run end to end, and the public API (PRESETS, init_params, loss_fn, load_weights,
save_weights, make_optimizer, newton_schulz). What an archive needs; its full suite lives in git
history (the commits before the record-89 swap)."""
import dataclasses
import importlib.util
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import COMPILE_CACHE, TINY_VOCAB
from records.logs import parse_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "records", "record20", "train_gpt.py")


@pytest.fixture(scope="module")
def r20():
    spec = importlib.util.spec_from_file_location("record20_train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.heavy(5)
def test_a_tiny_record20_run_trains_and_logs(synthetic_shards, tmp_path):
    """6 layers, 8 sequences of 128 tokens per step, 8 steps (the archive's old test settings), on the
    suite's tiny shards (their BOS is an ordinary token to record 20)."""
    flags = {"--preset": "cpu", "--num-layers": 6, "--vocab-size": TINY_VOCAB, "--seq-len": 128, "--batch-size": 1024,
             "--val-tokens": 1024, "--num-iterations": 8, "--cooldown-frac": 0.2, "--val-loss-every": 4,
             "--compile-cache-dir": COMPILE_CACHE, "--records-dir": tmp_path / "records", **synthetic_shards}
    result = subprocess.run([sys.executable, SCRIPT, *[str(x) for kv in flags.items() for x in kv]], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "records").iterdir()
    log = parse_log(str(path))
    assert log.status == "complete" and log.source == open(SCRIPT).read()
    assert [s for s, *_ in log.val_curve] == [0, 4, 8]
    assert log.val_curve[0][1] == pytest.approx(math.log(TINY_VOCAB), abs=1e-3)  # its head starts at zero
    assert log.val_curve[-1][1] < log.val_curve[0][1] - 1.5


def test_the_api_loads_saves_and_computes(r20, tmp_path):
    hp = dataclasses.replace(r20.PRESETS["cpu"], num_layers=6, vocab_size=1024, seq_len=128)
    params = r20.init_params(hp, 0)
    rng = np.random.default_rng()
    tokens = rng.integers(0, hp.vocab_size, 129)
    inputs, targets = jnp.asarray(tokens[:-1], jnp.int32), jnp.asarray(tokens[1:], jnp.int32)
    loss = float(r20.loss_fn(params, inputs, targets, jnp.int32(1), False))
    assert loss == pytest.approx(math.log(hp.vocab_size), abs=1e-3)  # zero head: uniform predictions
    noisy = {k: jnp.asarray(rng.standard_normal(p.shape), p.dtype) for k, p in params.items()}
    r20.save_weights(noisy, str(tmp_path / "w.npz"))
    loaded = r20.load_weights(str(tmp_path / "w.npz"), hp)
    assert loaded.keys() == noisy.keys()
    for k in noisy:
        np.testing.assert_array_equal(np.asarray(loaded[k], np.float32), np.asarray(noisy[k], np.float32))
    G = jax.random.normal(jax.random.PRNGKey(int(rng.integers(1 << 30))), (2, 64, 96))
    s = np.linalg.svd(np.asarray(r20.newton_schulz(G), np.float64), compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.5  # Newton-Schulz pushes singular values into ~[0.5, 1.5]
    assert hasattr(r20.make_optimizer(hp), "update")
