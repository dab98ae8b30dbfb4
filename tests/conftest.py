"""Shared test setup: the repo root on sys.path, no network for huggingface_hub."""
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def synthetic_shards(tmp_path_factory):
    """Small synthetic train (3 shards) and val shards, as flags for train_gpt.py."""
    from data.synthetic import write_synthetic_shards

    out = tmp_path_factory.mktemp("shards")
    write_synthetic_shards(str(out), seed=1, train_tokens=60_000, val_tokens=8_000, shard_tokens=20_000)
    return {"--train-files": str(out / "synthetic_train_*.bin"), "--val-files": str(out / "synthetic_val_*.bin")}


# A tiny run of train_gpt.py on the synthetic shards, as command-line flags (test_train, test_distributed).
TINY_FLAGS = {"--preset": "cpu", "--seq-len": 128, "--batch-size": 1024, "--val-tokens": 2048,
              "--num-iterations": 24, "--val-loss-every": 8, "--compile-cache-dir": ""}


@pytest.fixture
def tiny_args(synthetic_shards):
    """tiny_args(records, **overrides) -> argv for train_gpt.py."""
    def make(records, **overrides):
        args = {**TINY_FLAGS, "--records-dir": records, **synthetic_shards, **overrides}
        return [str(x) for kv in args.items() for x in kv]
    return make


@pytest.fixture
def run_train():
    """run_train(argv, **subprocess_kwargs): train_gpt.py in a subprocess, output captured."""
    def run(args, **kwargs):
        return subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py"), *args], capture_output=True,
                              text=True, timeout=900, cwd=ROOT, **kwargs)
    return run
