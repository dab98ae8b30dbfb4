"""Tokenize documents into shards with GPT-2's BPE (tiktoken), the format train_gpt.py reads.

  python data/fineweb.py INPUT... --out DIR [--name NAME] [--shard-tokens 100000000] [--separator LINE]
  python data/fineweb.py --fineweb-sample10bt K --out DIR     # raw FineWeb parquet (needs pyarrow)

Inputs: .txt files (one document per file, or documents split on lines equal to --separator, e.g.
'<|endoftext|>'), .jsonl files (one document per line, in its "text" field), .parquet files (a
"text" column; needs the optional package pyarrow), and folders (searched for those). Each document
is preceded by <|endoftext|> (50256) and documents are packed back to back across shards. The first
shard is the val shard NAME_val_000000.bin, the rest NAME_train_000001.bin, ... Shards appear under
their final names only when complete, and a run that does not finish (Ctrl-C, an input that turns
out unreadable or a record without text, a full disk) removes the shards it wrote: a val shard and
the first train shards would look like a complete set. The tool refuses an --out that already holds
NAME_* shards (exit 2). Relative paths are relative to the current folder. Tokenizing uses all
cores (--workers, in spawned processes). GPT-2's BPE is read from
data/gpt2.tiktoken, shipped with the repository, so tokenizing needs no network.
"""
import argparse
import base64
import collections
import concurrent.futures
import glob
import hashlib
import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.cached_fineweb10B import first_line, hub_answer, transport_errors  # noqa: E402
from data.shards import (OutputError, output_folder, read_header, refuse_old_shards,  # noqa: E402
                         removed_if_unfinished, write_failure, write_shard)

INPUT_TYPES = ("txt", "jsonl", "parquet")
MAX_SHARD_TOKENS = 2**31 - 1  # the header's int32 count

FINEWEB_REPO = "HuggingFaceFW/fineweb"
SAMPLE_10BT_FILES = 15  # sample/10BT/000_00000.parquet .. 014_00000.parquet (~2.1 GB each, the last ~0.55 GB)
CHUNK_DOCS = 256  # documents per task handed to a worker
OLD_SHARDS_FIX = "Delete them or choose another --out or --name."
# GPT-2's token ranks: tiktoken's r50k_base file (this hash is the one tiktoken checks it by), the ranks of
# its "gpt2" encoding too, which tiktoken would download from two other files.
GPT2_RANKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2.tiktoken")
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def input_files(paths: list) -> list:
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(p for ext in INPUT_TYPES
                            for p in glob.glob(os.path.join(path, "**", f"*.{ext}"), recursive=True))
        elif not os.path.exists(path):
            raise FileNotFoundError(f"input {path} does not exist (looked for {os.path.abspath(path)})")
        elif not path.endswith(tuple(f".{ext}" for ext in INPUT_TYPES)):
            raise ValueError(f"input {path}: not a .txt, .jsonl or .parquet file (a .json array, a compressed "
                             f"file: convert it to one document per line of .jsonl first)")
        else:
            files.append(path)
    return files


def pyarrow_parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise SystemExit("reading .parquet files needs pyarrow, an optional extra: pip install pyarrow") from None
    return pyarrow.parquet


def read_documents(path: str, separator: str | None = None):
    """Yield the documents (str) of one input file; ValueError names a file or record that is not text,
    or a file that cannot be read."""
    try:
        yield from _documents(path, separator)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror or e})") from None


def _documents(path: str, separator: str | None):
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        text = None
                    if not isinstance(text, str):
                        raise ValueError(f"{path} line {n} is not a JSON object with a 'text' field holding text")
                    yield text
    elif path.endswith(".parquet"):
        parquet = pyarrow_parquet().ParquetFile(path)
        if "text" not in parquet.schema_arrow.names:
            raise ValueError(f"{path} has no 'text' column (its columns: {', '.join(parquet.schema_arrow.names)})")
        for batch in parquet.iter_batches(columns=["text"]):
            texts = batch.column("text").to_pylist()
            if not all(isinstance(t, str) for t in texts):
                kind = next(type(t).__name__ for t in texts if not isinstance(t, str))
                raise ValueError(f"{path}: its 'text' column holds {kind} values, not only text")
            yield from texts
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if separator is None:
            if text.strip():  # an empty file is no document (as blank ones between separators)
                yield text
        else:
            docs, current = [], []
            for line in text.splitlines(keepends=True):
                if line.rstrip("\r\n") == separator:
                    docs.append("".join(current))
                    current = []
                else:
                    current.append(line)
            yield from (d for d in docs + ["".join(current)] if d.strip())


def gpt2_encoding():
    """tiktoken's GPT-2 encoding, built from the shipped ranks (tiktoken.get_encoding("gpt2") downloads them;
    its own loader would also copy the file into its download cache)."""
    import tiktoken
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str

    try:
        with open(GPT2_RANKS, "rb") as f:
            contents = f.read()
        problem = None if hashlib.sha256(contents).hexdigest() == GPT2_RANKS_SHA256 else "not the file it should be"
    except OSError as e:
        problem = e.strerror
    if problem:
        raise SystemExit(f"cannot read GPT-2's BPE ranks from {GPT2_RANKS} ({problem}): restore the repository's "
                         f"file (git checkout data/gpt2.tiktoken)")
    ranks = {base64.b64decode(token): int(rank) for token, rank in (line.split() for line in contents.splitlines())}
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


_worker_encoding = None  # set in each pool worker by _init_worker


def _encoding_definition(encoding) -> dict:
    """Everything needed to rebuild the encoding. Pickling a registered encoding (gpt2) sends only its name,
    and a spawned worker would then load the BPE files again: if that failed, the pool would respawn it forever."""
    return dict(name=encoding.name, pat_str=encoding._pat_str, mergeable_ranks=encoding._mergeable_ranks,
                special_tokens=encoding._special_tokens)


def _init_worker(definition):
    import tiktoken

    global _worker_encoding
    _worker_encoding = tiktoken.Encoding(**definition)


def _encode_chunk(docs: list) -> np.ndarray:
    return encode_documents(_worker_encoding, docs)


def encode_documents(encoding, docs: list) -> np.ndarray:
    """EOT + tokens of each document, back to back, as uint16."""
    out = []
    for tokens in encoding.encode_ordinary_batch(docs, num_threads=1):
        out.append([encoding.eot_token])
        out.append(tokens)
    return np.fromiter(itertools.chain.from_iterable(out), np.uint16) if out else np.zeros(0, np.uint16)


def write_token_stream(chunks, out_dir: str, name: str, shard_tokens: int, paths: list = None) -> list:
    """Cut a stream of token arrays into shards: first val, then train 1, 2, ...; each path is appended
    to `paths` (given: the caller's list) as its shard is written."""
    output_folder(out_dir)
    paths, buffer, filled = [] if paths is None else paths, np.empty(shard_tokens, np.uint16), 0

    def flush(n):
        split = "val" if not paths else "train"
        paths.append(os.path.join(out_dir, f"{name}_{split}_{len(paths):06d}.bin"))
        write_shard(paths[-1], buffer[:n])

    for tokens in chunks:
        while len(tokens):
            take = min(len(tokens), shard_tokens - filled)
            buffer[filled:filled + take] = tokens[:take]
            filled, tokens = filled + take, tokens[take:]
            if filled == shard_tokens:
                flush(filled)
                filled = 0
    if filled:
        flush(filled)
    return paths


def batched(iterable, n: int):
    it = iter(iterable)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def encoded_in_workers(encoding, chunks, workers: int):
    """Each chunk's tokens, in order, encoded in `workers` spawned processes (not forked: the caller may
    have imported JAX, whose threads a forked child could deadlock on), at most two chunks a worker in
    flight, fed from this thread: a multiprocessing.Pool's own feeder thread could block for ever on
    Ctrl-C. The workers start with SIGINT ignored (kept through exec, and Python then leaves it so):
    Ctrl-C stops this process's feeding, and an exception waits only for the chunks in flight."""
    context = multiprocessing.get_context("spawn")
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:  # the first `workers` submits start the workers
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                                      initargs=(_encoding_definition(encoding),))
        pending = collections.deque(pool.submit(_encode_chunk, c) for c in itertools.islice(chunks, workers))
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, handler)
    with pool:
        for chunk in chunks:
            pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def tokenize_to_shards(documents, out_dir: str, name: str = "fineweb", shard_tokens: int = 100_000_000,
                       encoding=None, workers: int = 1) -> list:
    """Tokenize an iterable of documents into shards (GPT-2's BPE unless an `encoding` is given). With
    workers > 1 chunks of documents are encoded in spawned processes, in order. Raises FileExistsError,
    writing nothing, when out_dir already holds NAME_* shards; any other exception removes the shards
    written so far (with the val shard first, they would look like a complete set)."""
    refuse_old_shards(out_dir, name, OLD_SHARDS_FIX)
    # Loaded here, once: a worker initializer that fails (no BPE files) would break every worker.
    encoding = encoding or gpt2_encoding()
    chunks = batched(documents, CHUNK_DOCS)
    encoded = (encode_documents(encoding, c) for c in chunks) if workers <= 1 else \
        encoded_in_workers(encoding, chunks, workers)
    try:
        with removed_if_unfinished([]) as written:
            return write_token_stream(encoded, out_dir, name, shard_tokens, written)
    finally:
        encoded.close()  # the workers' pool shut down now, not when the traceback is gone


class DownloadError(RuntimeError):
    pass


def download_fineweb_sample(k: int, out_dir: str) -> list:
    """The first k parquet files of FineWeb sample-10BT (raw text, ~2 GB each but the last), one at a time."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    paths, raw_dir = [], os.path.join(out_dir, "raw")
    for i in range(k):
        name = f"sample/10BT/{i:03d}_00000.parquet"
        print(f"[{i + 1}/{k}] {name}")
        try:
            paths.append(hf_hub_download(FINEWEB_REPO, name, repo_type="dataset", local_dir=raw_dir))
        except (HfHubHTTPError, *transport_errors()) as e:
            if answer := hub_answer(e):
                raise DownloadError(f"could not download {name}: the hub {FINEWEB_REPO} answered "
                                    f"{first_line(answer)}") from None
            raise DownloadError(f"could not download {name} from the Hugging Face dataset repo {FINEWEB_REPO} "
                                f"({type(e).__name__}). Connect to the internet (unset HF_HUB_OFFLINE; HF_ENDPOINT "
                                f"for a mirror), or download the parquet files elsewhere and pass them as inputs."
                                ) from None
        except OSError as e:  # writing the raw file: a full disk, a folder that cannot be written
            raise DownloadError(f"cannot write {name} into {os.path.abspath(raw_dir)} ({e.strerror or e}): make "
                                f"room, or choose another --out") from None
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", help=".txt, .jsonl, .parquet files or folders")
    parser.add_argument("--out", required=True, help="folder for the shards")
    parser.add_argument("--name", default="fineweb", help="shard name prefix")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help=f"tokens a shard, 1..{MAX_SHARD_TOKENS}")
    parser.add_argument("--separator", help="a line that separates documents inside .txt files")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizing processes, at least 1")
    parser.add_argument("--fineweb-sample10bt", type=int, default=0, metavar="K",
                        help="download and tokenize the first K raw FineWeb sample-10BT parquet files")
    args = parser.parse_args(argv)
    k = args.fineweb_sample10bt
    if not 1 <= args.shard_tokens <= MAX_SHARD_TOKENS:
        parser.error(f"--shard-tokens {args.shard_tokens}: must be in 1..{MAX_SHARD_TOKENS} (the header's int32 count)")
    if args.workers < 1:
        parser.error(f"--workers {args.workers}: must be at least 1")
    if not 0 <= k <= SAMPLE_10BT_FILES:
        parser.error(f"--fineweb-sample10bt takes 0..{SAMPLE_10BT_FILES} (the sample has {SAMPLE_10BT_FILES} files)")
    try:
        files = input_files(args.inputs)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    if not files and not k:
        parser.error("no inputs: give files or folders, or --fineweb-sample10bt K")
    try:  # checked again by tokenize_to_shards; here, before any download
        refuse_old_shards(args.out, args.name, OLD_SHARDS_FIX)
        output_folder(args.out)
    except (FileExistsError, OutputError) as e:
        parser.error(str(e))
    # Everything that can fail fast does so before any download or tokenizing, not hours later.
    if k or any(f.endswith(".parquet") for f in files):
        pyarrow_parquet()
    encoding = gpt2_encoding()
    if k:
        try:
            files += download_fineweb_sample(k, args.out)
        except DownloadError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    documents = (doc for path in files for doc in read_documents(path, args.separator))
    t0 = time.perf_counter()
    try:
        paths = tokenize_to_shards(documents, args.out, args.name, args.shard_tokens, encoding, args.workers)
    except ValueError as e:
        print(f"error: {e}; no shard kept: fix the input and run again", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, the folder made read-only meanwhile
        print(f"error: {write_failure(e, args.out, kept=False)}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    total = sum(read_header(p) for p in paths)
    print(f"wrote {len(paths)} shard{'s' * (len(paths) != 1)}, {total:,} tokens, to {os.path.abspath(args.out)} in "
          f"{seconds:.1f}s ({total / seconds:,.0f} tokens/s)")
    if len(paths) < 2:
        print(f"note: {'no shard' if not paths else 'only the val shard'}: the inputs hold {total:,} tokens, not "
              f"more than --shard-tokens {args.shard_tokens:,}; train_gpt.py needs train shards too (lower "
              f"--shard-tokens)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback
        print("interrupted: the shards this run wrote are removed (a set cut short would look complete)",
              file=sys.stderr)
        sys.exit(130)
