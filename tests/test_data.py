"""data/: the shard format, the downloader (offline), the tokenizer and the synthetic shards."""
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported: these tests never use the network

import huggingface_hub.constants  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tiktoken  # noqa: E402
from huggingface_hub.errors import RemoteEntryNotFoundError  # noqa: E402

from data import cached_fineweb10B, fineweb, synthetic  # noqa: E402
from data.shards import EOT, HEADER_BYTES, ShardError, open_shard, read_header, write_shard  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ---- shard format


def test_write_read_round_trip(tmp_path):
    rng = np.random.default_rng()
    tokens = rng.integers(0, 65536, int(rng.integers(1, 100_000)))
    path = str(tmp_path / "s.bin")
    write_shard(path, tokens)
    assert os.path.getsize(path) == HEADER_BYTES + 2 * len(tokens)
    assert read_header(path) == len(tokens)
    np.testing.assert_array_equal(open_shard(path), tokens)
    assert os.listdir(tmp_path) == ["s.bin"]  # no temporary file left behind


@pytest.mark.parametrize("damage", ["magic", "version", "truncated", "count_too_large", "trailing", "tiny"])
def test_damaged_shards_are_rejected_with_the_file_name(tmp_path, damage):
    path = tmp_path / f"shard_{damage}.bin"
    write_shard(str(path), np.arange(1000))
    data = bytearray(path.read_bytes())
    header = np.frombuffer(data[:HEADER_BYTES], "<i4").copy()
    if damage == "magic":
        header[0] = 12345
    elif damage == "version":
        header[1] = 2
    elif damage == "count_too_large":
        header[2] = 5000
    data[:HEADER_BYTES] = header.tobytes()
    if damage == "truncated":
        data = data[:-10]
    elif damage == "trailing":
        data += b"\0\0"
    elif damage == "tiny":
        data = data[:100]
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"shard_{damage}.bin"):
        open_shard(str(path))


def test_a_missing_shard_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardError) as e:
        read_header(os.path.join("sub", "nowhere.bin"))
    assert str(tmp_path / "sub" / "nowhere.bin") in str(e.value)


def test_a_failed_write_leaves_nothing_under_the_final_name(tmp_path, monkeypatch):
    path = str(tmp_path / "s.bin")
    with pytest.raises(ValueError, match="70000"):
        write_shard(path, [1, 2, 70000])
    with pytest.raises(ValueError, match="-1"):
        write_shard(path, [1, -1])
    with pytest.raises(ValueError, match="integers"):
        write_shard(path, [1.5])

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_shard(path, np.arange(100))
    assert os.listdir(tmp_path) == []


# ---- downloader


def test_offline_download_fails_fast_and_names_the_repo(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once, at import
    t0 = time.perf_counter()
    code = cached_fineweb10B.main(["1", "--out", str(tmp_path)])
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert code == 2 and "kjj0/fineweb10B-gpt2" in err and "fineweb_train_000001.bin" in err


def test_a_hub_whose_name_does_not_resolve_fails_at_once(tmp_path, capsys, monkeypatch):
    """No network: the name lookup fails, and the download says so without huggingface_hub's retries."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):  # (conftest sets the
        monkeypatch.delenv(name, raising=False)  # first; the others may come from the shell running the tests)
    lookups = []

    def no_dns(host, port, *args, **kwargs):
        lookups.append(host)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    t0 = time.perf_counter()
    assert cached_fineweb10B.main(["1", "--out", str(tmp_path)]) == 2
    assert time.perf_counter() - t0 < 5 and lookups == ["huggingface.co"] * 3  # three tries, a second apart
    err = capsys.readouterr().err
    assert "(ConnectionError: cannot resolve huggingface.co: Temporary failure in name resolution)" in err
    assert "Connect to the internet" in err and "fineweb_train_000001.bin" in err
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # behind a proxy the proxy resolves: no lookup here

    def through_the_proxy(**kwargs):  # (a stand-in: huggingface_hub would retry the dead proxy for ~25 s)
        raise ConnectionError("the proxy did not answer")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", through_the_proxy)
    assert cached_fineweb10B.main(["1", "--out", str(tmp_path)]) == 2
    assert "(ConnectionError: the proxy did not answer)" in capsys.readouterr().err


@pytest.mark.parametrize("n", [-1, 104, 100_000])
def test_download_count_is_bounded_by_the_dataset(tmp_path, capsys, n):
    with pytest.raises(SystemExit) as e:
        cached_fineweb10B.main([str(n), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"N is {n}" in err and "1..103" in err and len(err) < 1000
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="1..103"):
        cached_fineweb10B.download_shards(n, str(tmp_path / "out"), fake_hub([]), log=lambda *_: None)


def test_offline_error_for_all_103_shards_stays_short(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert cached_fineweb10B.main(["103", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"Missing in {tmp_path}: 104 files: fineweb_val_000000.bin, fineweb_train_000001.bin, " \
           "fineweb_train_000002.bin and 101 more." in err
    assert "fineweb_train_000003.bin" not in err and len(err) < 1000


def fake_hub(calls):
    def download(name, out_dir):
        calls.append(name)
        path = os.path.join(out_dir, name)
        write_shard(path, np.arange(2000) % 50257)
        return path
    return download


def test_valid_files_are_skipped_and_invalid_ones_replaced(tmp_path):
    calls = []
    assert cached_fineweb10B.download_shards(2, str(tmp_path), fake_hub(calls), log=lambda *_: None) == []
    assert calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    calls.clear()
    assert cached_fineweb10B.download_shards(2, str(tmp_path), fake_hub(calls), log=lambda *_: None) == []
    assert calls == []  # everything present and valid: no download at all
    (tmp_path / "fineweb_train_000002.bin").write_bytes(b"garbage")
    cached_fineweb10B.download_shards(2, str(tmp_path), fake_hub(calls), log=lambda *_: None)
    assert calls == ["fineweb_train_000002.bin"] and (tmp_path / "fineweb_train_000002.bin.bad").exists()


def test_a_file_the_hub_refuses_is_reported_and_the_rest_still_downloaded(tmp_path, capsys):
    calls = []

    def hub(name, out_dir):
        if name == "fineweb_train_000001.bin":
            no_response = SimpleNamespace(headers={}, request=None)
            raise RemoteEntryNotFoundError("404 Client Error: Entry Not Found", response=no_response)
        return fake_hub(calls)(name, out_dir)

    problems = cached_fineweb10B.download_shards(2, str(tmp_path), hub, log=lambda *_: None)
    assert calls == ["fineweb_val_000000.bin", "fineweb_train_000002.bin"]
    assert len(problems) == 1 and "fineweb_train_000001.bin" in problems[0] and "404" in problems[0]


def test_an_invalid_download_is_reported_and_not_used(tmp_path):
    def bad_hub(name, out_dir):
        path = os.path.join(out_dir, name)
        with open(path, "wb") as f:
            f.write(b"<html>rate limited</html>")
        return path

    problems = cached_fineweb10B.download_shards(0, str(tmp_path), bad_hub, log=lambda *_: None)
    assert len(problems) == 1 and "fineweb_val_000000.bin" in problems[0]
    assert not (tmp_path / "fineweb_val_000000.bin").exists()


# ---- tokenizer


def byte_encoding():
    """A byte-level BPE with no merges: a document's tokens are its bytes, counts easy to foresee."""
    return tiktoken.Encoding(name="bytes", pat_str=r"""\S+|\s+""", mergeable_ranks={bytes([i]): i for i in range(256)},
                             special_tokens={"<|endoftext|>": EOT})


def random_text(rng, n):
    words = ["".join(rng.choice(list("abcdefghij éü"), int(rng.integers(1, 8)))) for _ in range(n)]
    return " ".join(words)


@pytest.mark.parametrize("workers", [1, 2])
def test_tokenizer_layout_and_shard_split(tmp_path, workers):
    rng = np.random.default_rng()
    enc = byte_encoding()
    # more documents than one pool task (CHUNK_DOCS), so that worker order matters
    docs = [random_text(rng, int(rng.integers(5, 60))) for _ in range(int(rng.integers(300, 700)))]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs[:10]) + "\n")
    (tmp_path / "b.txt").write_text("\n<|endoftext|>\n".join(docs[10:]))
    files = fineweb.input_files([str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")])
    read = [d for f in files for d in fineweb.read_documents(f, separator="<|endoftext|>")]
    assert [d.strip() for d in read] == [d.strip() for d in docs]
    expected = np.concatenate([[EOT] + enc.encode_ordinary(d) for d in read])
    shard_tokens = int(rng.integers(len(expected) // 10, len(expected) // 2))
    paths = fineweb.tokenize_to_shards(read, str(tmp_path / "out"), "demo", shard_tokens, encoding=enc, workers=workers)
    names = [os.path.basename(p) for p in paths]
    assert names[0] == "demo_val_000000.bin"
    assert names[1:] == [f"demo_train_{i:06d}.bin" for i in range(1, len(paths))]
    assert all(read_header(p) == shard_tokens for p in paths[:-1]) and 0 < read_header(paths[-1]) <= shard_tokens
    np.testing.assert_array_equal(np.concatenate([open_shard(p) for p in paths]), expected)


def test_tokenizer_cli_writes_shards_and_refuses_to_mix_with_old_ones(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fineweb, "gpt2_encoding", byte_encoding)  # tokens = bytes: the shards' sizes below
    (tmp_path / "docs").mkdir()
    for i in range(5):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"document {i} " * 40)
    args = [str(tmp_path / "docs"), "--out", str(tmp_path / "out"), "--shard-tokens", "2000", "--workers", "1"]
    assert fineweb.main(args) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]  # 5 x 441
    assert "tokens/s" in capsys.readouterr().out
    before = {p: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    with pytest.raises(SystemExit) as e:
        fineweb.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "already holds 2 fineweb_* shards" in err
    assert "fineweb_train_000001.bin, fineweb_val_000000.bin" in err and "--out or --name" in err
    assert {p: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    with pytest.raises(FileExistsError):  # the library function refuses too
        fineweb.tokenize_to_shards(["a document"], str(tmp_path / "out"), encoding=byte_encoding())


def test_spawned_tokenizer_workers_do_not_fork_a_process_running_jax(tmp_path):
    jax = pytest.importorskip("jax")
    jax.devices()  # from now on JAX warns on every os.fork() in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths = fineweb.tokenize_to_shards(["some text " * 50] * 600, str(tmp_path), "w", 10_000,
                                           encoding=byte_encoding(), workers=2)
    assert [str(w.message) for w in caught if "fork" in str(w.message)] == []
    expected = np.tile([EOT] + byte_encoding().encode_ordinary("some text " * 50), 600)
    np.testing.assert_array_equal(np.concatenate([open_shard(p) for p in paths]), expected)


def test_interrupted_tokenization_leaves_only_complete_shards(tmp_path):
    enc = byte_encoding()

    def documents():
        for i in range(100):
            if i == 60:
                raise KeyboardInterrupt
            yield f"document number {i} " * 5

    with pytest.raises(KeyboardInterrupt):
        fineweb.tokenize_to_shards(documents(), str(tmp_path), "x", 1000, encoding=enc)
    assert os.listdir(tmp_path) == []  # a val shard and train 1..k would look like a complete set


# ---- synthetic shards


def test_synthetic_shards_are_deterministic_and_learnable(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 20))
    a = synthetic.write_synthetic_shards(str(tmp_path / "a"), seed, 300_000, 50_000, 200_000)
    b = synthetic.write_synthetic_shards(str(tmp_path / "b"), seed, 300_000, 50_000, 200_000)
    c = synthetic.write_synthetic_shards(str(tmp_path / "c"), seed + 1, 300_000, 50_000, 200_000)
    assert [os.path.basename(p) for p in a] == ["synthetic_val_000000.bin", "synthetic_train_000001.bin",
                                               "synthetic_train_000002.bin"]
    for pa, pb, pc in zip(a, b, c, strict=True):
        assert Path(pa).read_bytes() == Path(pb).read_bytes() != Path(pc).read_bytes()
    train = np.concatenate([open_shard(p) for p in a[1:]]).astype(np.int64)
    val = np.asarray(open_shard(a[0]), np.int64)
    assert train[0] == EOT and val[0] == EOT and 0.001 < np.mean(train == EOT) < 0.01
    # a bigram count model fit on train, scored on val (add-k smoothing over the padded vocabulary)
    k, V = 0.01, 50304
    pair_n = counts_of(train[:-1] * 65536 + train[1:], val[:-1] * 65536 + val[1:])
    prev_n = counts_of(train[:-1], val[:-1])
    cross_entropy = -np.mean(np.log((pair_n + k) / (prev_n + k * V)))
    assert cross_entropy < 0.5 * np.log(V)


def test_synthetic_fineweb_like_options_set_document_length_and_a_zipf_like_vocabulary(tmp_path, capsys):
    """--mean-doc-len 1000 --vocab 50257: documents of ~1,000 tokens; most GPT-2 ids in use, with
    frequencies that fall by rank (the default model uses 2,048 ids about evenly)."""
    synthetic.main(["--out", str(tmp_path / "z"), "--train-tokens", "1000000", "--val-tokens", "1000", "--mean-doc-len",
                    "1000", "--vocab", "50257", "--seed", str(int(np.random.default_rng().integers(1 << 20)))])
    tokens = np.asarray(open_shard(str(tmp_path / "z" / "synthetic_train_000001.bin")), np.int64)
    assert 700 < 1 / np.mean(tokens == EOT) < 1400  # mean document length
    counts = np.sort(np.bincount(tokens[tokens != EOT], minlength=EOT))[::-1]
    assert np.count_nonzero(counts) > 20_000  # a default-model shard holds at most 2,048 ids
    assert counts[0] > 30 * counts[1000] > 0  # Zipf-like: the commonest ids far above the thousandth
    default = np.asarray(synthetic.synthetic_tokens(1_000_000, 0), np.int64)
    assert len(np.unique(default)) <= 2049
    for bad in (["--vocab", "50258"], ["--vocab", "2"], ["--mean-doc-len", "0"]):
        with pytest.raises(SystemExit) as e:
            synthetic.main(["--out", str(tmp_path / "bad"), *bad])
        assert e.value.code == 2 and bad[0] in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_synthetic_refuses_a_folder_with_shards_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "syn"
    synthetic.main(["--out", str(out), "--train-tokens", "3000", "--val-tokens", "500", "--shard-tokens", "1500"])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["synthetic_train_000001.bin", "synthetic_train_000002.bin", "synthetic_val_000000.bin"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # one shard, another seed: would have left train_000002 of the old set
        synthetic.main(["--out", str(out), "--seed", "7", "--train-tokens", "1000", "--val-tokens", "500"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{out} already holds 3 synthetic_* shards" in err
    assert "synthetic_train_000001.bin, synthetic_train_000002.bin, synthetic_val_000000.bin" in err
    assert "Delete them or choose another --out" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_synthetic_val_shard_is_written_last(tmp_path, monkeypatch):
    """run.sh takes a folder with the val shard as a complete set."""
    written = []
    monkeypatch.setattr(synthetic, "write_shard", lambda path, tokens: written.append(os.path.basename(path)))
    synthetic.write_synthetic_shards(str(tmp_path), 0, 3000, 500, 1000)
    assert written == [f"synthetic_train_{i:06d}.bin" for i in (1, 2, 3)] + ["synthetic_val_000000.bin"]


def counts_of(seen, queries):
    """How often each query value occurs in `seen`."""
    values, counts = np.unique(seen, return_counts=True)
    at = np.minimum(np.searchsorted(values, queries), len(values) - 1)
    return np.where(values[at] == queries, counts[at], 0)


def test_gpt2_bpe_comes_from_the_shipped_ranks_without_network(tmp_path, monkeypatch):
    """data/fineweb.py's GPT-2 encoding reads data/gpt2.tiktoken, not the network (any download fails here):
    "Hello world" is [15496, 995] (the example of Hugging Face's GPT2Tokenizer documentation), <|endoftext|>
    50256, 50257 tokens. A missing or altered file is named, with the fix."""
    import requests

    def no_network(*args, **kwargs):
        raise AssertionError(f"a download: {args}")

    monkeypatch.setattr(requests, "get", no_network)
    enc = fineweb.gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995] and enc.n_vocab == 50257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT]
    altered = tmp_path / "gpt2.tiktoken"
    altered.write_bytes(Path(fineweb.GPT2_RANKS).read_bytes()[:-100])
    for path in (tmp_path / "nowhere.tiktoken", altered):
        monkeypatch.setattr(fineweb, "GPT2_RANKS", str(path))
        with pytest.raises(SystemExit, match=f"cannot read GPT-2's BPE ranks from {path}.*git checkout"):
            fineweb.gpt2_encoding()


def test_missing_gpt2_bpe_fails_at_once_instead_of_respawning_workers(tmp_path, monkeypatch):
    def missing():
        raise SystemExit("cannot read GPT-2's BPE ranks")

    monkeypatch.setattr(fineweb, "gpt2_encoding", missing)
    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match="GPT-2's BPE"):
        fineweb.tokenize_to_shards(["a document"] * 10, str(tmp_path), workers=2)
    assert time.perf_counter() - t0 < 10


# ---- paths and run.sh


def run_tool(args, cwd):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_data_tools_default_folders_are_relative_to_the_current_folder(tmp_path):
    r = run_tool([str(ROOT / "data" / "synthetic.py"), "--train-tokens", "2000", "--val-tokens", "500"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "data" / "synthetic"
    assert sorted(os.listdir(out)) == ["synthetic_train_000001.bin", "synthetic_val_000000.bin"]
    assert str(out) in r.stdout  # the message names the absolute folder
    r = run_tool([str(ROOT / "data" / "cached_fineweb10B.py"), "1"], tmp_path)
    assert r.returncode == 2 and f"Missing in {tmp_path / 'data' / 'fineweb10B'}: 2 files" in r.stderr
    r = run_tool([str(ROOT / "data" / "fineweb.py"), "nowhere.txt", "--out", "x"], tmp_path)
    assert r.returncode == 2 and str(tmp_path / "nowhere.txt") in r.stderr


def test_run_sh_help_answers_before_any_data_work(tmp_path):
    """run.sh --help prints its usage and train_gpt.py's options, without downloading or writing shards."""
    repo = tmp_path / "repo"  # a copy without data: what run.sh would download or generate shows up in it
    (repo / "data").mkdir(parents=True)
    sources = [p.relative_to(ROOT) for p in (ROOT / "data").glob("*.py")]
    for name in ["run.sh", "train_gpt.py", "requirements.txt", *sources]:
        shutil.copy2(ROOT / name, repo / name)
    venv_bin = os.path.dirname(sys.executable)
    env = dict(os.environ, VIRTUAL_ENV=os.path.dirname(venv_bin), PATH=venv_bin + os.pathsep + os.environ["PATH"],
               HF_HUB_OFFLINE="1", PIP_NO_INDEX="1")  # the packages are here already: no network needed
    r = subprocess.run([str(repo / "run.sh"), "--num-scheduled-iterations", "5", "--help"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ./run.sh [--script PATH] [train_gpt.py options]")
    assert "--num-scheduled-iterations" in r.stdout and "--stage-batch-sizes" in r.stdout  # train_gpt.py --help
    assert list(repo.rglob("*.bin")) == [] and not (repo / "data" / "fineweb10B").exists()
    assert not (repo / "data" / "synthetic").exists()


def test_run_sh_runs_pip_only_when_the_requirements_changed(tmp_path):
    """run.sh's pip step is skipped when this environment already got the same requirements (a stamp in
    its folder): a changed requirements.txt installs again, and a failed install leaves no stamp."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ["run.sh", "requirements.txt"]:
        shutil.copy2(ROOT / name, repo / name)
    (repo / "plain.py").write_text("print('help')\n")  # --help's script: quick, without JAX
    venv = tmp_path / "venv"  # the stamps' folder; python and its packages stay the test run's
    venv.mkdir()
    venv_bin = os.path.dirname(sys.executable)
    env = dict(os.environ, VIRTUAL_ENV=str(venv), PATH=venv_bin + os.pathsep + os.environ["PATH"], PIP_NO_INDEX="1")

    def run():
        return subprocess.run([str(repo / "run.sh"), "--script", "plain.py", "--help"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    assert run().returncode == 0
    (first,) = venv.glob(".run_sh_pip_*")
    assert run().returncode == 0 and list(venv.glob(".run_sh_pip_*")) == [first]  # the same: no pip
    with open(repo / "requirements.txt", "a") as f:
        f.write("# changed\n")
    assert run().returncode == 0 and len(list(venv.glob(".run_sh_pip_*"))) == 2  # changed: pip ran, stamped
    with open(repo / "requirements.txt", "a") as f:
        f.write("no-such-package-anywhere==1.0\n")
    r = run()
    assert r.returncode != 0 and len(list(venv.glob(".run_sh_pip_*"))) == 2  # failed: no stamp, pip again next time


def test_run_sh_sets_up_one_process_at_a_time(tmp_path):
    """Processes started at once on one machine (one per GPU under SLURM) take turns through run.sh's
    set-up and data: one that holds its lock, as another run.sh in its pip install would, holds the next
    back until it lets go."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ["run.sh", "requirements.txt"]:
        shutil.copy2(ROOT / name, repo / name)
    (repo / "plain.py").write_text("print('help')\n")
    venv_bin = os.path.dirname(sys.executable)
    env = dict(os.environ, VIRTUAL_ENV=os.path.dirname(venv_bin), PATH=venv_bin + os.pathsep + os.environ["PATH"],
               PIP_NO_INDEX="1")
    with open(repo / ".run_sh.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen([str(repo / "run.sh"), "--script", "plain.py", "--help"], cwd=tmp_path, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(2)
            waited = proc.poll() is None
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = proc.communicate(timeout=120)
    assert waited and "another run.sh in" in err and "waiting for it" in err, (out, err)
    assert proc.returncode == 0 and out.rstrip().endswith("help"), err


# ---- what users met (a review, 2026-11-28): broken connections, full or read-only folders, bad inputs


def test_a_connection_that_breaks_mid_file_is_a_message_and_exit_2(tmp_path, capsys, monkeypatch):
    import httpx2

    done = []

    def breaks(repo_id, filename, repo_type, local_dir):  # the val shard arrives, train shard 1's connection drops
        if filename == "fineweb_train_000001.bin":
            raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body")
        return fake_hub(done)(filename, local_dir)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(cached_fineweb10B, "resolve", lambda host: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", breaks)
    assert cached_fineweb10B.main(["2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "could not download fineweb_train_000001.bin" in err and "RemoteProtocolError" in err
    assert "Missing in" in err and "fineweb_train_000002.bin" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["fineweb_val_000000.bin"]


def test_a_hub_that_answers_with_an_error_is_not_told_to_connect(tmp_path):
    """huggingface_hub wraps a failed lookup's HTTP error (a 403, a 500) in LocalEntryNotFoundError."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    def refuses(name, out_dir):
        try:
            raise HfHubHTTPError("403 Forbidden: gated", response=SimpleNamespace(headers={}, request=None))
        except HfHubHTTPError as e:
            raise LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub") from e

    problems = cached_fineweb10B.download_shards(0, str(tmp_path), refuses, log=lambda *_: None)
    assert problems == ["fineweb_val_000000.bin: the hub kjj0/fineweb10B-gpt2 answered: HfHubHTTPError: 403 "
                        "Forbidden: gated"]


def test_a_bad_file_set_aside_never_replaces_an_earlier_one(tmp_path):
    calls = []
    for garbage in (b"first garbage", b"second garbage"):
        (tmp_path / "fineweb_val_000000.bin").write_bytes(garbage)
        cached_fineweb10B.download_shards(0, str(tmp_path), fake_hub(calls), log=lambda *_: None)
    assert (tmp_path / "fineweb_val_000000.bin.bad").read_bytes() == b"first garbage"
    assert (tmp_path / "fineweb_val_000000.bin.bad.1").read_bytes() == b"second garbage"


def test_a_present_shard_of_another_size_is_named(tmp_path):
    write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(3000) % 50257)  # not FineWeb's 100M tokens
    lines = []
    assert cached_fineweb10B.download_shards(0, str(tmp_path), fake_hub([]), log=lines.append) == []
    assert lines == ["[1/1] fineweb_val_000000.bin: present, valid; note: 3,000 tokens where kjj0/fineweb10B-gpt2's "
                     "hold 100,000,000: a shard of your own under FineWeb's name? (it is used as it is)"]


@pytest.mark.parametrize("tool", ["download", "tokenize", "synthetic"])
def test_an_out_folder_that_cannot_be_written_is_a_message_and_exit_2(tool, tmp_path, capsys):
    (tmp_path / "docs.txt").write_text("a document\n")
    run = {"download": lambda out: cached_fineweb10B.main(["0", "--out", out]),
           "tokenize": lambda out: fineweb.main([str(tmp_path / "docs.txt"), "--out", out, "--workers", "1"]),
           "synthetic": lambda out: synthetic.main(["--out", out, "--train-tokens", "1000", "--val-tokens", "100"])}[tool]
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    for out, message in ((str(a_file), f"{a_file} is a file, not a folder"),
                         (str(a_file / "sub"), f"cannot make the --out folder {a_file / 'sub'}")):
        try:
            code = run(out)
        except SystemExit as e:  # argparse's error
            code = e.code
        assert code == 2 and message in capsys.readouterr().err, (tool, out)
    assert a_file.read_text() == "keep me"


def test_a_write_that_fails_half_way_is_a_message_and_leaves_no_partial_set(tmp_path, capsys, monkeypatch):
    written = []

    def fills_up(path, tokens):  # the disk is full from the third shard on
        if len(written) == 2:
            raise OSError(28, "No space left on device", str(path))
        written.append(path)
        real_write_shard(path, tokens)

    real_write_shard = synthetic.write_shard
    monkeypatch.setattr(synthetic, "write_shard", fills_up)
    code = synthetic.main(["--out", str(tmp_path / "s"), "--train-tokens", "3000", "--val-tokens", "100",
                           "--shard-tokens", "1000"])
    err = capsys.readouterr().err
    assert code == 2 and "No space left on device" in err and "make room" in err and "Traceback" not in err
    assert "the shards this run wrote are removed" in err and len(written) == 2
    assert os.listdir(tmp_path / "s") == []  # they would only block a rerun
    monkeypatch.setattr(synthetic, "write_shard", real_write_shard)  # room again: the rerun is not refused
    assert synthetic.main(["--out", str(tmp_path / "s"), "--train-tokens", "3000", "--val-tokens", "100",
                           "--shard-tokens", "1000"]) == 0


def shards_then_a_bad_input(tmp_path, monkeypatch) -> tuple:
    """(a .jsonl of 2 x CHUNK_DOCS documents, ~31K tokens, the shard paths written): given first, with
    --shard-tokens 10000, its first chunks are encoded and written as shards before the tokenizer reads
    the input after it (with fewer than a chunk's documents, the bad input would fail before any shard)."""
    good = tmp_path / "a_good.jsonl"
    good.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                            for i in range(2 * fineweb.CHUNK_DOCS)))
    written = []
    monkeypatch.setattr(fineweb, "write_shard", lambda path, tokens: (written.append(path), write_shard(path, tokens)))
    return good, written


@pytest.mark.parametrize("content, message", [
    ('{"text": "fine"}\n{"text": 5}\n', "docs.jsonl line 2 is not a JSON object with a 'text' field holding text"),
    ('{"text": null}\n', "docs.jsonl line 1 is not a JSON object"),
    (b'{"text": "caf\xe9"}\n', "docs.jsonl is not UTF-8 text (invalid continuation byte at byte 13)"),
])
def test_an_input_that_is_not_text_is_a_message_and_leaves_no_shard(content, message, tmp_path, capsys, monkeypatch):
    good, written = shards_then_a_bad_input(tmp_path, monkeypatch)
    bad = tmp_path / "docs.jsonl"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "out"
    assert fineweb.main([str(good), str(bad), "--out", str(out), "--shard-tokens", "10000", "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and "no shard kept" in err and "Traceback" not in err
    assert written and os.listdir(out) == []  # written, then removed: no set that looks complete, no refused rerun


def test_the_tokenizer_refuses_other_file_types_and_nonsense_sizes(tmp_path, capsys):
    (tmp_path / "docs.json").write_text('[{"text": "a"}]')
    (tmp_path / "docs.txt").write_text("a document\n")
    for args, message in (([str(tmp_path / "docs.json")], "not a .txt, .jsonl or .parquet file"),
                          ([str(tmp_path / "docs.txt"), "--workers", "0"], "--workers 0: must be at least 1"),
                          ([str(tmp_path / "docs.txt"), "--shard-tokens", str(2**31)], "must be in 1..2147483647")):
        with pytest.raises(SystemExit) as e:
            fineweb.main([*args, "--out", str(tmp_path / "out")])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as e:
        synthetic.main(["--out", str(tmp_path / "s"), "--seed", "-1"])
    assert e.value.code == 2 and "--seed -1: must be 0 or more" in capsys.readouterr().err


def test_ctrl_c_while_tokenizing_is_a_line_not_tracebacks(tmp_path):
    """The spawned workers leave Ctrl-C to the parent (three tracebacks before), which says what stays."""
    text = random_text(np.random.default_rng(), 500)
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(20000):  # ~10M tokens: seconds of work left when the first shard appears
            f.write(json.dumps({"text": f"{i} {text}"}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "data/fineweb.py", str(tmp_path / "docs.jsonl"), "--out", str(out),
                             "--shard-tokens", "20000", "--workers", "2"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # Ctrl-C reaches the group
    try:
        deadline = time.time() + 60
        while not (out.exists() and any(p.endswith(".bin") for p in os.listdir(out))) and time.time() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()  # still tokenizing when the first shard is there
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "interrupted: the shards this run wrote are removed" in err and os.listdir(out) == []


def test_an_input_that_cannot_be_read_is_named_as_such_and_leaves_no_shard(tmp_path, capsys, monkeypatch):
    good, written = shards_then_a_bad_input(tmp_path, monkeypatch)
    unreadable = tmp_path / "mem.txt"  # opens, then every read fails (EIO): as a disk error would
    unreadable.symlink_to("/proc/self/mem")
    out = tmp_path / "out"
    assert fineweb.main([str(good), str(unreadable), "--out", str(out), "--shard-tokens", "10000",
                         "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {unreadable} (Input/output error); no shard kept" in err and "cannot write" not in err
    assert written and os.listdir(out) == []


def test_empty_files_are_no_documents_and_a_val_only_result_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fineweb, "gpt2_encoding", byte_encoding)  # tokens = bytes
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "doc.txt").write_text("one document")
    assert fineweb.main([str(tmp_path / "empty.txt"), str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"),
                         "--workers", "1"]) == 0
    assert read_header(str(tmp_path / "out" / "fineweb_val_000000.bin")) == 1 + len("one document")  # EOT + bytes
    out = capsys.readouterr().out
    assert "wrote 1 shard, 13 tokens" in out
    assert "note: only the val shard: the inputs hold 13 tokens, not more than --shard-tokens 100,000,000" in out
