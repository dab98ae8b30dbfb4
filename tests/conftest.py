"""Shared test setup: the repo root on sys.path, no network for huggingface_hub."""
import os
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
