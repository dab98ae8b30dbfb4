"""The token shard format, read and written in one place for the data/ tools and the tests (train_gpt.py,
which stands alone, carries its own reader of the same format; a test keeps the two in agreement).

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, token count N, zeros),
then N little-endian uint16 GPT-2 token ids: 1024 + 2·N bytes in all.
"""
import contextlib
import glob
import os

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
EOT = 50256  # <|endoftext|>: precedes every document


class ShardError(ValueError):
    """A shard file that cannot be used; the message names the file and the fix."""


class OutputError(OSError):
    """Shards cannot be written where asked; the message names the folder and the fix."""


def output_folder(out_dir: str, flag: str = "--out") -> str:
    """Make the folder shards go to (absolute path returned), or raise OutputError saying why not."""
    path = os.path.abspath(out_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"{flag} {path} is a file, not a folder: choose a folder for the shards")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot make the {flag} folder {path} ({e.strerror}): choose a folder this user can "
                          f"write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"the {flag} folder {path} cannot be written: choose a folder this user can write to")
    return path


def write_failure(e: OSError, out_dir: str, kept: bool, flag: str = "--out") -> str:
    """The message of a write that failed half-way (a full disk...): what, where, and what became of the
    shards finished before it (kept: a rerun skips them; else the tool removed them)."""
    what = e.strerror or str(e)
    before = (f"the shards finished before it stay in {os.path.abspath(out_dir)} (a rerun skips them)" if kept
              else "the shards this run wrote are removed")
    return (f"cannot write {e.filename or 'a shard'} ({what}); {before}: make room (or choose another {flag}) and "
            f"run again")


@contextlib.contextmanager
def removed_if_unfinished(paths: list):
    """with removed_if_unfinished(paths): write shards, appending each path to `paths`. If the block ends
    with an exception (Ctrl-C, a full disk, a bad input), the shards written so far are removed: a val
    shard and the first train shards would look like a complete set, and would block a rerun."""
    try:
        yield paths
    except BaseException:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)
        raise


def write_shard(path, tokens) -> None:
    """Write tokens as a shard. The file appears under its final name only once complete (written to
    a temporary name, synced, then renamed), so an interrupted write never leaves a valid-looking shard."""
    tokens = np.asarray(tokens)
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens for {path} must be integers, got dtype {tokens.dtype}")
    lo, hi = (int(tokens.min()), int(tokens.max())) if tokens.size else (0, 0)
    if lo < 0 or hi > 65535:
        raise ValueError(f"token id {lo if lo < 0 else hi} does not fit a uint16 shard ({path})")
    header = np.zeros(HEADER_INTS, "<i4")
    header[:3] = MAGIC, VERSION, tokens.size
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.astype("<u2").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_header(path) -> int:
    """Validate a shard's header and size; return its token count."""
    fix = ("if it is a shard, delete it and re-download it (python data/cached_fineweb10B.py N) or regenerate "
           "it (data/fineweb.py, data/synthetic.py); if not, give a path or pattern that matches shards only")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"cannot read shard {os.path.abspath(path)}: {e.strerror}. Download it "
                         f"(python data/cached_fineweb10B.py N), generate it (data/fineweb.py, data/synthetic.py) "
                         f"or fix the path") from None
    if size < HEADER_BYTES:
        raise ShardError(f"{path} is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header: truncated? {fix}")
    header = np.frombuffer(raw, "<i4")
    if header[0] != MAGIC:
        raise ShardError(f"{path} is not a token shard (magic {header[0]}, expected {MAGIC}): {fix}")
    if header[1] != VERSION:
        raise ShardError(f"{path} has shard version {header[1]}, this code reads version {VERSION}: {fix}")
    count = int(header[2])
    if size != HEADER_BYTES + 2 * count:
        state = "truncated" if size < HEADER_BYTES + 2 * count else "longer than its header says"
        raise ShardError(f"{path} is {state}: {size} bytes for {count} tokens "
                         f"(expected {HEADER_BYTES + 2 * count}): {fix}")
    return count


def open_shard(path) -> np.ndarray:
    """The shard's tokens as a read-only uint16 memory map, after validating the header and size."""
    count = read_header(path)
    if count == 0:  # numpy cannot map zero bytes
        return np.zeros(0, "<u2")
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))


def refuse_old_shards(out_dir: str, name: str, fix: str) -> None:
    """Raise FileExistsError when out_dir already holds NAME_*.bin shards: new shards written beside them
    (fewer, or another seed) would leave old ones that a NAME_train_*.bin glob still picks up."""
    old = sorted(glob.glob(os.path.join(glob.escape(out_dir), f"{glob.escape(name)}_*.bin")))
    if old:
        shown = ", ".join(os.path.basename(p) for p in old[:3]) + (f" and {len(old) - 3} more" if len(old) > 3 else "")
        raise FileExistsError(f"{os.path.abspath(out_dir)} already holds {len(old)} {name}_* shards ({shown}); "
                              f"new shards beside them would mix two datasets under one glob. {fix}")
