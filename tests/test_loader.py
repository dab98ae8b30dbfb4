"""§4 Data: the shard reader inside train_gpt.py against data/shards.py (the writer), the loader's
virtual-rank rule, and the path rule (relative to the current folder, errors print absolute paths)."""
import os

import numpy as np
import pytest

import train_gpt as tg
from data import shards
from data.shards import ShardError, write_shard

def reference_batches(shards, batch_size, seq_len, rows):
    """The spec's loader written as the reference loop: check, slice each rank, advance."""
    shard_iter = iter(shards)
    tokens, pos = next(shard_iter), 0
    while True:
        if pos + batch_size + 1 >= len(tokens):
            try:
                tokens, pos = next(shard_iter), 0
            except StopIteration:
                return
            if pos + batch_size + 1 >= len(tokens):
                continue
        yield ([tokens[pos + r * seq_len: pos + r * seq_len + seq_len] for r in rows],
               [tokens[pos + r * seq_len + 1: pos + r * seq_len + seq_len + 1] for r in rows])
        pos += batch_size


def test_loader_follows_the_virtual_rank_rule_across_shard_boundaries(tmp_path):
    rng = np.random.default_rng()
    B, S = 512, 128
    sizes = [int(rng.integers(3 * B, 4 * B)), 2 * B + 1, B + 1, int(rng.integers(2 * B + 2, 3 * B))]  # B+1: no step fits
    shards = [rng.integers(0, 65536, n).astype(np.uint16) for n in sizes]
    paths = [str(tmp_path / f"t_{i:06d}.bin") for i in range(len(shards))]
    for p, s in zip(paths, shards):
        write_shard(p, s)
    assert tg.steps_available(paths, B) == len(list(reference_batches(shards, B, S, range(4))))
    for rows in (range(0, 4), range(2, 4), range(1, 2)):  # all virtual ranks, or one process's share
        got = list(tg.token_windows(paths, B, S, rows))
        want = list(reference_batches(shards, B, S, rows))
        assert len(got) == len(want) > 0
        for (x, y), (wx, wy) in zip(got, want):
            assert x.dtype == np.int32 and x.shape == (len(rows), S)
            np.testing.assert_array_equal(x, np.stack(wx))
            np.testing.assert_array_equal(y, np.stack(wy))


def test_loader_rejects_bad_shards_naming_the_file(tmp_path):
    good = str(tmp_path / "a_000000.bin")
    write_shard(good, np.arange(4096) % 1000)
    bad = str(tmp_path / "b_000001.bin")
    with open(good, "rb") as f:
        data = f.read()
    with open(bad, "wb") as f:
        f.write(data[:-100])  # truncated
    with pytest.raises(tg.DataError, match="b_000001.bin"):
        list(tg.token_windows([good, bad], 1024, 128, range(8)))
    with pytest.raises(tg.DataError, match="b_000001.bin"):
        tg.steps_available([good, bad], 1024)




def shard_variants(tmp_path, rng):
    """A good shard and every kind of bad one: name -> path."""
    tokens = rng.integers(0, 65536, int(rng.integers(1, 5000)))
    good = tmp_path / "good.bin"
    write_shard(str(good), tokens)
    data = good.read_bytes()
    variants = {"good": data, "empty_tokens": None, "bad_magic": b"\x00" + data[1:], "bad_version": None,
                "truncated": data[:-2], "trailing": data + b"\x00\x00", "tiny": data[:100], "missing": None}
    header = np.frombuffer(data[:1024], "<i4").copy()
    header[1] = 2
    variants["bad_version"] = header.tobytes() + data[1024:]
    paths = {}
    for name, content in variants.items():
        path = tmp_path / f"{name}.bin"
        if name == "empty_tokens":
            write_shard(str(path), np.zeros(0, np.int64))
        elif content is not None:
            path.write_bytes(content)
        paths[name] = str(path)
    return paths, tokens


def test_reader_agrees_with_data_shards_on_good_and_bad_files(tmp_path):
    paths, tokens = shard_variants(tmp_path, np.random.default_rng())
    for name, path in paths.items():
        try:
            theirs = shards.open_shard(path)
        except ShardError:
            theirs = None
        try:
            ours = tg.open_shard(path)
        except tg.DataError as e:
            assert os.path.abspath(path) in str(e)  # names the file
            ours = None
        assert (theirs is None) == (ours is None), name
        if ours is not None:
            np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(tg.open_shard(paths["good"]), tokens)


def test_constants_shared_with_data_and_records_agree():
    from records import logs

    assert tg.EOT == shards.EOT
    assert (tg.SHARD_MAGIC, tg.SHARD_VERSION, tg.SHARD_HEADER_BYTES) == (shards.MAGIC, shards.VERSION,
                                                                          shards.HEADER_BYTES)
    assert tg.RULE == logs.RULE


def test_relative_patterns_are_relative_to_the_current_folder(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    write_shard(str(tmp_path / "data" / "x_000001.bin"), np.arange(10))
    monkeypatch.chdir(tmp_path)
    assert tg.shard_files("data/x_*.bin", "--train-files") == ["data/x_000001.bin"]
    with pytest.raises(tg.DataError) as e:
        tg.shard_files("data/y_*.bin", "--val-files")
    assert str(tmp_path / "data" / "y_*.bin") in str(e.value)
