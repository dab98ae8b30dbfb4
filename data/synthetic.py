"""Synthetic token shards for offline runs and tests: learnable, deterministic from a seed.

Text comes from a sparse random bigram model over a subset of the GPT-2 vocabulary: each of
`vocab_used` token ids has `successors` possible next tokens with random probabilities, and a
document ends with probability 1/mean_doc_len after each token. Every document starts with 50256,
as in FineWeb shards. A model that learns the bigram table reaches a loss near the table's entropy
(at most ln(successors)), far below ln(50304). By default 2,048 ids, each as likely a successor as
any other, and documents of ~400 tokens; for benchmarks whose embedding, head and bigram-table costs
should look like FineWeb's, `--vocab 50257` uses every GPT-2 id but 50256 with Zipf-like frequencies
(successors drawn with probability ~ 1/rank^0.7: about 34,000 distinct ids in 2M tokens, the
commonest 1.1% of them) and `--mean-doc-len 1000` FineWeb-like documents.

  python data/synthetic.py [--out data/synthetic] [--seed 0] [--train-tokens N] [--val-tokens M] [--shard-tokens S]
                           [--mean-doc-len 400] [--vocab V]

writes synthetic_val_000000.bin and synthetic_train_000001.bin, ... in the shard format, into --out
(relative to the current folder). It refuses a folder that already holds synthetic_* shards (exit 2,
nothing written): delete them or choose another --out. The val shard is written last, so a folder
with the val shard holds a complete set (run.sh relies on this).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import (EOT, OutputError, output_folder, refuse_old_shards, removed_if_unfinished,  # noqa: E402
                         write_failure, write_shard)

STREAM_TOKENS = 4000  # tokens per independent stream; streams are advanced together (vectorised)


def bigram_model(seed: int, vocab_used: int = 2048, successors: int = 4, zipf: bool = False):
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0]))
    token_ids = rng.choice(EOT, vocab_used, replace=False)  # spread over 0..50255
    if zipf:  # a few states are everyone's successors, most are rare: token frequencies fall like text's
        p = 1 / np.arange(1, vocab_used + 1) ** 0.7
        next_state = rng.choice(vocab_used, (vocab_used, successors), p=p / p.sum())
    else:
        next_state = rng.integers(0, vocab_used, (vocab_used, successors))
    cumulative = np.cumsum(rng.dirichlet(np.ones(successors), vocab_used), axis=1)
    return token_ids, next_state, cumulative


def synthetic_tokens(n: int, seed: int, stream: int = 1, mean_doc_len: int = 400, vocab: int = None) -> np.ndarray:
    """n tokens (uint16) of the seed's bigram model; `stream` picks a disjoint random stream (train/val).
    vocab: None for the 2,048-id model, else the vocabulary size V: V - 1 ids (50256 excluded), Zipf-like."""
    if n <= 0:
        return np.zeros(0, np.uint16)
    token_ids, next_state, cumulative = bigram_model(seed) if vocab is None else bigram_model(seed, vocab - 1, zipf=True)
    rng = np.random.default_rng(np.random.SeedSequence([seed, stream]))
    streams = max(1, n // STREAM_TOKENS)
    steps = -(-n // streams)
    out = np.empty((steps, streams), np.uint16)
    state = rng.integers(0, len(token_ids), streams)
    out[0] = EOT  # every stream starts a document
    for t in range(1, steps):
        ends = rng.random(streams) < 1 / mean_doc_len
        choice = (rng.random(streams)[:, None] > cumulative[state]).sum(axis=1)
        choice = np.minimum(choice, next_state.shape[1] - 1)  # guards cumsum rounding below 1.0
        state = np.where(ends, rng.integers(0, len(token_ids), streams), next_state[state, choice])
        out[t] = np.where(ends, EOT, token_ids[state])
    return out.T.reshape(-1)[:n]  # stream after stream


def write_synthetic_shards(out_dir: str, seed: int = 0, train_tokens: int = 20_000_000, val_tokens: int = 2_000_000,
                           shard_tokens: int = 10_000_000, mean_doc_len: int = 400, vocab: int = None) -> list:
    """Train shards of shard_tokens each, then the val shard (its own random stream); returns their paths, val
    first. Raises FileExistsError, writing nothing, when out_dir already holds synthetic_* shards."""
    refuse_old_shards(out_dir, "synthetic", "Delete them or choose another --out.")
    output_folder(out_dir)
    text = dict(mean_doc_len=mean_doc_len, vocab=vocab)
    train = synthetic_tokens(train_tokens, seed, stream=1, **text)
    paths = [os.path.join(out_dir, "synthetic_val_000000.bin")]
    with removed_if_unfinished(paths):  # (a full disk, Ctrl-C: its train shards would only block a rerun)
        for i, start in enumerate(range(0, train_tokens, shard_tokens)):
            paths.append(os.path.join(out_dir, f"synthetic_train_{i + 1:06d}.bin"))
            write_shard(paths[-1], train[start:start + shard_tokens])
        write_shard(paths[0], synthetic_tokens(val_tokens, seed, stream=2, **text))  # last: marks a complete set
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join("data", "synthetic"),
                        help="folder for the shards, relative to the current folder (default: data/synthetic)")
    parser.add_argument("--seed", type=int, default=0, help="of the token streams, 0 or more")
    parser.add_argument("--train-tokens", type=int, default=20_000_000)
    parser.add_argument("--val-tokens", type=int, default=2_000_000)
    parser.add_argument("--shard-tokens", type=int, default=10_000_000)
    parser.add_argument("--mean-doc-len", type=int, default=400, help="mean document length in tokens (FineWeb's: ~1000)")
    parser.add_argument("--vocab", type=int, help="vocabulary size V: V - 1 token ids with Zipf-like frequencies "
                        "(50257: all of GPT-2's); default: the 2,048-id model")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error(f"--seed {args.seed}: must be 0 or more")
    if min(args.train_tokens, args.val_tokens) < 0 or args.shard_tokens < 1:
        parser.error("token counts must be >= 0 and --shard-tokens >= 1")
    if args.mean_doc_len < 1:
        parser.error(f"--mean-doc-len {args.mean_doc_len}: must be at least 1")
    if args.vocab is not None and not 2 < args.vocab <= EOT + 1:
        parser.error(f"--vocab {args.vocab}: must be in 3..{EOT + 1} (the ids below {EOT}, plus {EOT} itself)")
    t0 = time.perf_counter()
    try:
        paths = write_synthetic_shards(args.out, args.seed, args.train_tokens, args.val_tokens, args.shard_tokens,
                                       args.mean_doc_len, args.vocab)
    except (FileExistsError, OutputError) as e:
        parser.error(str(e))
    except OSError as e:  # a full disk, the folder made read-only meanwhile
        print(f"error: {write_failure(e, args.out, kept=False)}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    total = args.train_tokens + args.val_tokens
    print(f"wrote {len(paths)} synthetic shards ({total:,} tokens) to {os.path.abspath(args.out)} in {seconds:.1f}s "
          f"({total / seconds:,.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback
        print("interrupted: the shards this run wrote are removed", file=sys.stderr)
        sys.exit(130)
