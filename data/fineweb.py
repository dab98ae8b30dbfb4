"""Tokenize documents into shards with GPT-2's BPE (tiktoken), the format train_gpt.py reads.

  python data/fineweb.py INPUT... --out DIR [--name NAME] [--shard-tokens 100000000] [--separator LINE]
  python data/fineweb.py --fineweb-sample10bt K --out DIR     # raw FineWeb parquet (needs pyarrow)

Inputs: .txt files (one document per file, or documents split on lines equal to --separator, e.g.
'<|endoftext|>'), .jsonl files (one document per line, in its "text" field), .parquet files (a
"text" column; needs the optional package pyarrow), and folders (searched for those). Each document
is preceded by <|endoftext|> (50256) and documents are packed back to back across shards. The first
shard is the val shard NAME_val_000000.bin, the rest NAME_train_000001.bin, ... Shards appear under
their final names only when complete. Tokenizing uses all cores (--workers).
"""
import argparse
import glob
import itertools
import json
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import write_shard  # noqa: E402

FINEWEB_REPO = "HuggingFaceFW/fineweb"
CHUNK_DOCS = 256  # documents per task handed to a worker


def input_files(paths: list) -> list:
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(p for ext in ("txt", "jsonl", "parquet")
                            for p in glob.glob(os.path.join(path, "**", f"*.{ext}"), recursive=True))
        elif os.path.exists(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"input {path} does not exist")
    return files


def read_documents(path: str, separator: str = None):
    """Yield the documents (str) of one input file."""
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{path} line {n} is not a JSON object with a 'text' field") from None
    elif path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SystemExit(f"reading {path} needs pyarrow, an optional extra: pip install pyarrow") from None
        for batch in pq.ParquetFile(path).iter_batches(columns=["text"]):
            yield from batch.column("text").to_pylist()
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if separator is None:
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
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001  (tiktoken raises network errors of several kinds)
        raise SystemExit(
            f"tiktoken could not load the GPT-2 BPE ({type(e).__name__}). It downloads two files once and caches "
            f"them in TIKTOKEN_CACHE_DIR: connect to the internet once, or point TIKTOKEN_CACHE_DIR at a folder "
            f"that holds them."
        ) from None


_worker_encoding = None


def _init_worker():
    global _worker_encoding
    _worker_encoding = gpt2_encoding()


def _encode_chunk(docs: list) -> np.ndarray:
    return encode_documents(_worker_encoding, docs)


def encode_documents(encoding, docs: list) -> np.ndarray:
    """EOT + tokens of each document, back to back, as uint16."""
    out = []
    for tokens in encoding.encode_ordinary_batch(docs, num_threads=1):
        out.append([encoding.eot_token])
        out.append(tokens)
    return np.fromiter(itertools.chain.from_iterable(out), np.uint16) if out else np.zeros(0, np.uint16)


def write_token_stream(chunks, out_dir: str, name: str, shard_tokens: int) -> list:
    """Cut a stream of token arrays into shards: first val, then train 1, 2, ..."""
    os.makedirs(out_dir, exist_ok=True)
    paths, buffer, filled = [], np.empty(shard_tokens, np.uint16), 0

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


def tokenize_to_shards(documents, out_dir: str, name: str = "fineweb", shard_tokens: int = 100_000_000,
                       encoding=None, workers: int = 1) -> list:
    """Tokenize an iterable of documents into shards. With workers > 1 the GPT-2 encoding runs in a
    process pool (order kept); an injected `encoding` runs in this process."""
    chunks = batched(documents, CHUNK_DOCS)
    if encoding is not None or workers <= 1:
        encoding = encoding or gpt2_encoding()
        return write_token_stream((encode_documents(encoding, c) for c in chunks), out_dir, name, shard_tokens)
    gpt2_encoding()  # fail here, once, if the BPE files cannot be had (a failing pool initializer would respawn forever)
    with multiprocessing.Pool(workers, initializer=_init_worker) as pool:
        return write_token_stream(pool.imap(_encode_chunk, chunks, chunksize=4), out_dir, name, shard_tokens)


def download_fineweb_sample(k: int, out_dir: str) -> list:
    """The first k parquet files of FineWeb sample-10BT (raw text), one at a time."""
    from huggingface_hub import hf_hub_download

    return [hf_hub_download(FINEWEB_REPO, f"sample/10BT/{i:03d}_00000.parquet", repo_type="dataset",
                            local_dir=os.path.join(out_dir, "raw")) for i in range(k)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", help=".txt, .jsonl, .parquet files or folders")
    parser.add_argument("--out", required=True, help="folder for the shards")
    parser.add_argument("--name", default="fineweb", help="shard name prefix")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000)
    parser.add_argument("--separator", help="a line that separates documents inside .txt files")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--fineweb-sample10bt", type=int, default=0, metavar="K",
                        help="download and tokenize the first K raw FineWeb sample-10BT parquet files")
    args = parser.parse_args(argv)
    files = input_files(args.inputs)
    if args.fineweb_sample10bt:
        files += download_fineweb_sample(args.fineweb_sample10bt, args.out)
    if not files:
        parser.error("no inputs: give files or folders, or --fineweb-sample10bt K")
    documents = (doc for path in files for doc in read_documents(path, args.separator))
    t0 = time.perf_counter()
    paths = tokenize_to_shards(documents, args.out, args.name, args.shard_tokens, workers=args.workers)
    seconds = time.perf_counter() - t0
    total = sum(os.path.getsize(p) - 1024 for p in paths) // 2
    print(f"wrote {len(paths)} shards, {total:,} tokens, to {args.out} in {seconds:.1f}s ({total / seconds:,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
