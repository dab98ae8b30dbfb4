"""§4 Data: the 8-GPU streams of train_gpt.py against brute-force per-token readings of the rules
(plain Python loops over the shard tokens, written from the reference's description, not from the
vectorised code), on small synthetic shards written here; the shard reader against data/shards.py
(the writer), and the path rule (relative to the current folder, errors print absolute paths)."""
import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

import train_gpt as tg
from data import shards
from data.shards import ShardError, write_shard

BOS = tg.BOS

# Small stages (T = 256, 512, 768 tokens per rank chunk; max_seq_len 96, then 200) over 12 + 3 steps:
# stage bounds 0, 4, 8, 12, 15.
SMALL_STAGES = tuple(dataclasses.replace(s, batch_size=8 * t, max_seq_len=m)
                     for s, t, m in zip(tg.RECORD_STAGES, (256, 512, 768, 768), (96, 200, 200, 200)))
SMALL = dataclasses.replace(tg.PRESETS["record"], stages=SMALL_STAGES, num_scheduled_iterations=12,
                            num_extension_iterations=3, val_batch_size=8 * 128, val_tokens=4 * 8 * 128)


def synthetic_tokens(rng, size, mean_doc, lead):
    """Random non-BOS tokens, a BOS at every document start (exponential lengths), `lead` tokens before
    the first document (a shard that starts mid-document)."""
    tokens = rng.integers(0, BOS, size)
    pos = lead
    while pos < size:
        tokens[pos] = BOS
        pos += 1 + int(rng.exponential(mean_doc))
    return tokens


@pytest.fixture(scope="module")
def train_files(tmp_path_factory):
    """4 shards of 15,000 to 24,000 tokens, documents of mean length 60 (some longer than 96 or 200)."""
    rng, folder = np.random.default_rng(89), tmp_path_factory.mktemp("train")
    paths = []
    for k, size in enumerate((24_000, 15_000, 22_000, 30_000)):
        paths.append(str(folder / f"train_{k:06d}.bin"))
        write_shard(paths[-1], synthetic_tokens(rng, size, 60, lead=(0, 37, 5, 0)[k]))
    return paths


def brute_train(paths, hp, steps):
    """Per step, per rank: (tokens of the T+1 buffer, document number of each buffer token, shard index),
    reading the shards token by token."""
    shards = [[int(t) for t in tg.open_shard(p)] for p in paths]
    k, p, out = 0, 0, []
    for step in range(steps):
        stage = hp.stages[tg.stage_of(step, hp)[0]]
        T, msl = stage.batch_size // 8, stage.max_seq_len
        while True:
            shard, q, chunks = shards[k], p, []
            for _ in range(8):
                buf, doc = [], []
                while len(buf) < T + 1:
                    while q < len(shard) and shard[q] != BOS:  # skip to the next document
                        q += 1
                    if q == len(shard):
                        break
                    n = 0
                    while len(buf) < T + 1 and n < msl and q < len(shard) and (n == 0 or shard[q] != BOS):
                        buf.append(shard[q])
                        doc.append(len(set(doc)) if n == 0 else doc[-1])
                        q, n = q + 1, n + 1
                if len(buf) < T + 1:
                    break
                chunks.append((buf, doc))
            if len(chunks) == 8:
                break
            k, p = k + 1, 0  # the step's batch did not fit: it comes from the next shard's first BOS
        p = q
        out.append((chunks, k))
    return out


def brute_bigram(row, vocab):
    """The reference's get_bigram_hash with Python ints and explicit 32-bit wrapping."""
    def wrap(v):
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= 1 << 31 else v
    mod, out = vocab - 1, []
    for i, cur in enumerate(row):
        prev = mod if i <= 1 else row[i - 1]
        out.append(mod if i == 0 else (wrap(36313 * cur) ^ wrap(27191 * prev)) % mod)
    return out


def model_docs(inputs_T):
    """The model's document numbers: a BOS opens a document (train_gpt.py sequence_loss)."""
    return np.cumsum(np.asarray(inputs_T) == BOS).tolist()


def model_bigrams(inputs_T, vocab):
    return np.asarray(tg.bigram_hash(jnp.asarray(inputs_T, jnp.int32), vocab)).tolist()


def test_train_stream_matches_token_by_token_reading(train_files):
    steps = 15
    brute = brute_train(train_files, SMALL, steps)
    docs = list(zip(range(steps), tg.train_docs(SMALL, train_files)))
    shards = [sd.shard for _, sd in docs]
    assert [k for _, k in brute] == shards
    switches = [s for s in range(1, steps) if shards[s] != shards[s - 1]]
    assert len(switches) >= 2 and shards[-1] == 3, shards  # the stream crosses shards ...
    assert any(s not in (4, 8) for s in switches)  # ... also inside a stage
    for (step, sd), (chunks, _) in zip(docs, brute):
        c = tg.chunks_of(sd)
        T = SMALL.stages[tg.stage_of(step, SMALL)[0]].batch_size // 8
        assert c.inputs.shape == c.targets.shape == (8, T)
        assert c.cu_seqlens.shape == (8, tg.max_num_docs(T)) and all(a.dtype == np.int32 for a in c)
        for r, (buf, doc) in enumerate(chunks):
            assert c.inputs[r].tolist() == buf[:-1] and c.targets[r].tolist() == buf[1:], (step, r)
            lengths = np.bincount(doc[:-1])  # the last target is not an input: the last document is one shorter
            cu = [0, *np.cumsum(lengths).tolist()]
            assert c.cu_seqlens[r].tolist() == cu + [T] * (c.cu_seqlens.shape[1] - len(cu)), (step, r)
            assert model_docs(c.inputs[r]) == [k + 1 for k in doc[:-1]], (step, r)  # every chunk starts at a BOS
            assert (sd.ends[r] - sd.starts[r]).sum() == T + 1
            if step % 5 == 0:  # the model's in-graph bigram hash of the chunk, as the reference's loader makes it
                assert model_bigrams(c.inputs[r], SMALL.bigram_vocab_size) == brute_bigram(buf[:-1], SMALL.bigram_vocab_size)


def test_max_num_docs():
    # The record's table at its three rank sizes, its formula at the validation size, >= 128 for tiny T.
    assert [tg.max_num_docs(T) for T in (16384, 32768, 49152, 262144, 2048, 256)] == [64, 96, 128, 896, 128, 128]


@pytest.fixture(scope="module")
def val_files(tmp_path_factory):
    """File 0 holds 2 steps of 1024 tokens (the third would reach its end), file 1 the rest."""
    rng, folder = np.random.default_rng(7), tmp_path_factory.mktemp("val")
    paths = [str(folder / f"val_{k:06d}.bin") for k in range(2)]
    write_shard(paths[0], synthetic_tokens(rng, 2500, 50, lead=0))
    write_shard(paths[1], synthetic_tokens(rng, 3000, 50, lead=11))
    return paths


def test_val_stream(val_files):
    shards = [[int(t) for t in tg.open_shard(p)] for p in val_files]
    got = list(tg.val_chunks(SMALL, val_files))
    assert len(got) == 4
    Tv = 128
    for step, c in enumerate(got):
        shard, pos = (shards[0], step * 1024) if step < 2 else (shards[1], (step - 2) * 1024)
        for r in range(8):
            window = shard[pos + r * Tv: pos + (r + 1) * Tv + 1]
            assert c.inputs[r].tolist() == window[:-1] and c.targets[r].tolist() == window[1:]
            bos = [t for t in range(Tv) if window[t] == BOS]
            assert c.cu_seqlens[r].tolist() == [0] + bos + [Tv] * (128 - 1 - len(bos))
            assert model_docs(window[:-1]) == [sum(1 for b in bos if b <= t) for t in range(Tv)]
    assert got[0].inputs[0, 0] == BOS and got[0].cu_seqlens[0, 1] == 0  # a chunk starting with BOS: empty first doc


def test_val_runs_out(val_files):
    with pytest.raises(tg.DataError, match="val shards ran out at validation step 2"):
        list(tg.val_chunks(dataclasses.replace(SMALL, val_tokens=5 * 1024), val_files[:1]))


def test_train_runs_out_names_the_step(train_files):
    got = 0  # steps yielded before the error
    with pytest.raises(tg.DataError, match="train shards ran out at step") as e:
        for _ in tg.train_docs(SMALL, train_files[:2]):
            got += 1
    assert 0 < got < 15 and f"at step {got}:" in str(e.value) and "cached_fineweb10B" in str(e.value)


def test_shards_without_a_document_start_are_named_as_such(tmp_path):
    """No --bos-id token in any shard (another tokenizer's, or not token shards): not 'ran out at step 0'."""
    path = str(tmp_path / "no_bos.bin")
    write_shard(path, np.random.default_rng().integers(0, tg.BOS, 200_000))
    with pytest.raises(tg.DataError, match=f"hold no --bos-id {tg.BOS} token, which starts each document"):
        next(tg.train_docs(SMALL, [path]))


def test_too_many_documents(tmp_path):
    path = str(tmp_path / "short_docs.bin")
    write_shard(path, np.tile([BOS, 5], 20_000))  # 2-token documents: 129 per chunk of 256 tokens
    with pytest.raises(tg.DataError, match="step 0: a rank's 256 tokens hold 129 documents"):
        next(tg.train_docs(SMALL, [path]))


def test_bad_shards(tmp_path):
    good = tmp_path / "good.bin"
    write_shard(str(good), np.arange(100))
    raw = good.read_bytes()
    cases = {"magic.bin": b"\0\0\0\0" + raw[4:], "short.bin": raw[:-2], "header.bin": raw[:100], "odd.bin": raw[:10]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(tg.DataError, match=str(tmp_path / name)) as e:
            next(tg.train_chunks(SMALL, [str(tmp_path / name)]))
        assert "cached_fineweb10B" in str(e.value)
    with pytest.raises(tg.DataError, match="--train-files"):
        tg.shard_files(str(tmp_path / "nothing_*.bin"), "--train-files")


# ---- the shard reader: the same files as data/shards.py, and paths relative to the current folder


def shard_variants(tmp_path, rng):
    """A good shard and every kind of bad one: name -> path."""
    tokens = rng.integers(0, 65536, int(rng.integers(1, 5000)))
    good = tmp_path / "good.bin"
    write_shard(str(good), tokens)
    data = good.read_bytes()
    variants = {"good": data, "empty_tokens": None, "bad_magic": b"\x00" + data[1:], "bad_version": None,
                "truncated": data[:-2], "trailing": data + b"\x00\x00", "tiny": data[:100], "ten_bytes": data[:10],
                "missing": None}
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

    assert tg.BOS == shards.EOT
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
