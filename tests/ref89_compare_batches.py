"""Same batches as the reference (issue 33): train_gpt.py (section 4)'s training stream against the
record-89 reference's own loader, replayed by ref89.py `batches` (not part of the test suite).

    python tests/ref89_compare_batches.py --shard-dir /tmp/me/shards --torch-python ~/.cache/seed-torch-venv/bin/python \
        --ref89 /work/shared/ref89/ref89.py [--steps 0,1,423,847,1270] [--ranks 0,7] [--delete]

Writes synthetic shards (5 x 100M tokens, documents of exponential length, mean 1000; odd shards
start mid-document) into --shard-dir unless it holds them already, then runs `ref89.py batches` for
world size 8 at each rank of --ranks and for world size 1, and compares every field with
np.array_equal: W=8 rank R against our chunk R; W=1 micro-batch k against our chunk k (equal up to the
reference's first shard switch; after it the reference's W=1 stream differs by design, ours stays the
8-GPU one). Besides --steps it compares the steps around each of our shard switches.
Needs REF89_GIT (see ref89's README); ref89 runs under flock /tmp/ref89.lock.
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import write_shard  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import train_gpt as tg  # noqa: E402

FIELDS = ("inputs", "targets", "cu_seqlens", "bigram_inputs", "bigram_cpu")


def make_shards(folder, count, size, seed=0):
    rng = np.random.default_rng(seed)
    for k in range(count):
        lengths = np.maximum(1, rng.exponential(1000, size // 500).astype(np.int64))
        bos = (137 * (k % 2)) + np.concatenate([[0], np.cumsum(lengths)])  # odd shards start mid-document
        tokens = rng.integers(0, tg.BOS, size, dtype=np.uint16)
        tokens[bos[bos < size]] = tg.BOS
        write_shard(os.path.join(folder, f"synth_train_{k:06d}.bin"), tokens)
        print(f"wrote shard {k}: {size} tokens, {int((bos < size).sum())} documents", flush=True)


def our_stream(hp, files, last, wanted):
    """{step: (StepDocs, Chunks)} at the wanted steps, the shard of every step 0..last, replay seconds."""
    t0, out, shards = time.time(), {}, []
    for step, docs in zip(range(last + 1), tg.train_docs(hp, files)):
        shards.append(docs.shard)
        if step in wanted:
            out[step] = docs, tg.chunks_of(docs)
    return out, shards, time.time() - t0


def run_ref(args, pattern, steps, world, rank, out):
    cmd = ["flock", "/tmp/ref89.lock", args.torch_python, args.ref89, "batches", pattern, out, "--steps",
           ",".join(map(str, steps)), "--world-size", str(world), "--rank", str(rank)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return np.load(out)


def compare(ref, key, docs, chunks, r):
    """(fields equal, fields differing, where the documents first differ) of one rank chunk."""
    bigrams = np.asarray(jax.vmap(lambda x: tg.bigram_hash(x, tg.PRESETS["record"].bigram_vocab_size))(
        jnp.asarray(chunks.inputs)))  # the model hashes in-graph; the reference's loader, on the host
    ours = dict(zip(FIELDS, (*chunks, bigrams, bigrams)))
    ours = {k: v[r] for k, v in ours.items()}
    ends = docs.ends[r].copy()
    ends[-1] -= 1  # the reference's end_idxs after its in-place decrement (targets[-1] = shard[ends[-1]])
    ours.update(doc_starts=docs.starts[r], doc_ends=ends, shard=np.array(docs.shard))
    good, bad = [], []
    for name, v in ours.items():
        (good if np.array_equal(ref[key + name], v) else bad).append(name)
    where = ""
    if bad:
        rs, os_ = ref[key + "doc_starts"], ours["doc_starts"]
        n = min(len(rs), len(os_))
        first = next((i for i in range(n) if rs[i] != os_[i] or ref[key + "doc_ends"][i] != ours["doc_ends"][i]), n)
        where = (f"shard ref {int(ref[key + 'shard'])} / ours {docs.shard}; first different document #{first}: ref "
                 f"{rs[first:first + 1].tolist()}..{ref[key + 'doc_ends'][first:first + 1].tolist()} ours "
                 f"{os_[first:first + 1].tolist()}..{ours['doc_ends'][first:first + 1].tolist()}")
    dtypes = f"targets ref {ref[key + 'targets'].dtype} ours {ours['targets'].dtype}"
    return good, bad, where, dtypes


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard-dir", required=True)
    p.add_argument("--torch-python", default=os.path.expanduser("~/.cache/seed-torch-venv/bin/python"))
    p.add_argument("--ref89", default="/work/shared/ref89/ref89.py")
    p.add_argument("--steps", default="0,1,423,847,1270")
    p.add_argument("--ranks", default="0,7")
    p.add_argument("--shards", type=int, default=5)
    p.add_argument("--shard-tokens", type=int, default=100_000_000)
    p.add_argument("--delete", action="store_true", help="delete --shard-dir when done")
    args = p.parse_args()
    if "REF89_GIT" not in os.environ:
        sys.exit("set REF89_GIT (ref89's README: the modded-nanogpt git directory)")

    os.makedirs(args.shard_dir, exist_ok=True)
    pattern = os.path.join(args.shard_dir, "synth_train_*.bin")
    if len(glob.glob(pattern)) != args.shards:
        make_shards(args.shard_dir, args.shards, args.shard_tokens)
    files = tg.shard_files(pattern, "--train-files")
    hp = tg.PRESETS["record"]

    steps = sorted({int(s) for s in args.steps.split(",")})
    _, shards, replay_s = our_stream(hp, files, steps[-1], set())
    switches = [s for s in range(1, len(shards)) if shards[s] != shards[s - 1]]
    print(f"our stream: steps 0..{steps[-1]} replayed (documents only) in {replay_s:.1f} s; shard switches at "
          f"steps {switches}")
    steps = sorted(set(steps) | {t for s in switches for t in (s - 1, s)})
    ours, _, replay_s = our_stream(hp, files, steps[-1], set(steps))
    print(f"our stream with chunks at {len(steps)} steps: {replay_s:.1f} s")
    docs, _ = ours[steps[-1]]
    t0 = time.time()
    for _ in range(5):
        tg.chunks_of(docs)
    print(f"chunks_of at step {steps[-1]} (8 x {ours[steps[-1]][1].inputs.shape[1]} tokens): "
          f"{(time.time() - t0) / 5 * 1e3:.1f} ms")

    tmp = tempfile.mkdtemp(prefix="ref89_batches_")
    table, details, dtypes = {}, [], ""  # table[step][run label] = cell text
    try:
        runs = [(8, r) for r in map(int, args.ranks.split(","))] + [(1, 0)]
        for world, rank in runs:
            t0 = time.time()
            ref = run_ref(args, pattern, steps, world, rank, os.path.join(tmp, f"w{world}r{rank}.npz"))
            print(f"ref89 batches W={world} rank {rank}: {time.time() - t0:.1f} s")
            label = f"W=8 rank {rank}" if world == 8 else "W=1 micro 0-7"
            for step in steps:
                cells = []
                for k in ([rank] if world == 8 else range(8)):
                    key = f"step{step}/" if world == 8 else f"step{step}/micro{k}/"
                    good, bad, where, dtypes = compare(ref, key, *ours[step], k)
                    if not bad:
                        cells.append(f"{len(good)}/{len(good)}" if world == 8 else "=")
                        continue
                    docs = ours[step][0]
                    same = [j for j in range(8) if int(ref[key + "shard"]) == docs.shard
                            and np.array_equal(ref[key + "doc_starts"], docs.starts[j])]
                    cells.append(f"{len(good)}/{len(good) + len(bad)}" if world == 8 else
                                 (f"=c{same[0]}" if same else "x"))
                    details.append(f"step {step} {label.split(' micro')[0]} {'micro' if world == 1 else 'rank'} {k}: "
                                   f"{','.join(bad)} differ; {where}")
                table.setdefault(step, {})[label] = " ".join(cells)
    finally:
        shutil.rmtree(tmp)
    labels = [f"W=8 rank {r}" for r in map(int, args.ranks.split(","))] + ["W=1 micro 0-7"]
    print(f"\nfields: {', '.join(FIELDS)}, doc_starts, doc_ends, shard ({dtypes}; values compared with "
          f"np.array_equal). W=8: equal fields of rank R vs our chunk R. W=1: per micro-batch k, '=' all "
          f"fields equal our chunk k, '=cJ' it is our chunk J of the same step, 'x' neither")
    print(f"{'step':>5} {'our shard':>9}  " + "  ".join(f"{lab:<16}" for lab in labels))
    for step in steps:
        print(f"{step:>5} {ours[step][0].shard:>9}  " + "  ".join(f"{table[step].get(lab, ''):<16}" for lab in labels))
    w8_bad = [x for x in details if "W=8" in x]
    w1_bad = sorted({int(x.split()[1]) for x in details if "W=1" in x})
    print(f"\nW=8: {'all equal' if not w8_bad else f'{len(w8_bad)} chunks differ'}; W=1: micro-batches differ "
          f"at steps {w1_bad} (our shard switches: {switches})")
    shown = set()  # the first difference of each step and run
    for line in details:
        if tuple(line.split()[:3]) not in shown:
            shown.add(tuple(line.split()[:3]))
            print("  " + line)
    if args.delete:
        shutil.rmtree(args.shard_dir)
        print(f"deleted {args.shard_dir}")


if __name__ == "__main__":
    main()
