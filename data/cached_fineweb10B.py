"""Download GPT-2-tokenized FineWeb shards (the speedrun's data) from the Hugging Face hub.

  python data/cached_fineweb10B.py N [--out DIR]

fetches fineweb_val_000000.bin and train shards 1..N (100M tokens each; the repo has 103, and 8 hold
what record 89 reads, 339M tokens from about 410M of shards, and record 20's 730M) from the dataset
repo kjj0/fineweb10B-gpt2 into --out
(default data/fineweb10B, relative to the current folder), one file at a time.
Shards already present and valid are skipped without touching the network; one whose token count
is not FineWeb's 100M is named (a shard of your own under FineWeb's name?). Every file's header and
size are checked; a bad one is moved aside (NAME.bad, or NAME.bad.1, ... : none is overwritten) and
reported. Exit code 0 when all N+1 shards are valid, 1 when a file was bad or the hub refused it, 2
when the hub cannot be reached or the connection broke, --out cannot be written (a full disk), or N
is not in 0..103.
"""
import argparse
import importlib
import os
import socket
import sys
import time
import urllib.parse
import urllib.request

from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import OutputError, ShardError, output_folder, read_header, write_failure  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"
TRAIN_SHARDS = 103  # fineweb_train_000001.bin .. fineweb_train_000103.bin in REPO_ID
# Each of REPO_ID's shards, the val shard too: the PyTorch speedrun's data/fineweb.py wrote them at its
# default --shard_size 10**8, a shard only once full, the first one as val (the last train shard may hold fewer).
SHARD_TOKENS = 100_000_000
DEFAULT_OUT = os.path.join("data", "fineweb10B")  # relative to the current folder, like every path given


class HubUnreachable(RuntimeError):
    pass


def transport_errors() -> tuple:
    """The HTTP client's errors for a connection that broke or stalled mid-file (huggingface_hub 2 uses
    httpx2, earlier versions httpx or requests), besides Python's own ConnectionError and TimeoutError."""
    found = [ConnectionError, TimeoutError, LocalEntryNotFoundError, OfflineModeIsEnabled]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "RequestException")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def hub_answer(e: BaseException):
    """The hub's HTTP error behind an exception, if it answered (huggingface_hub wraps a failed lookup's
    HTTP error, a 403 or a 500, in LocalEntryNotFoundError), else None: no answer at all."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, HfHubHTTPError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def set_aside(path: str) -> str:
    """Move a bad file to PATH.bad (PATH.bad.1, ... when taken: an earlier one is kept); its new name."""
    bad, k = path + ".bad", 0
    while os.path.lexists(bad):
        k += 1
        bad = f"{path}.bad.{k}"
    os.replace(path, bad)
    return bad


def shard_names(n: int) -> list:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n + 1)]


def hf_download(name: str, out_dir: str) -> str:
    """One file from the hub (never snapshot_download: offline it returns an empty folder, no error)."""
    from huggingface_hub import constants, hf_hub_download

    # (offline mode fails at once, with its own message; behind a proxy, the proxy looks names up)
    endpoint = urllib.parse.urlparse(constants.ENDPOINT)
    if not constants.HF_HUB_OFFLINE and not urllib.request.getproxies().keys() & {endpoint.scheme, "all"}:
        resolve(endpoint.hostname)
    return hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=out_dir)


def resolve(host: str, tries: int = 3) -> None:
    """The hub's name looked up first: where that fails (no network), huggingface_hub would retry the
    request 5 times over ~25 s; a ConnectionError says so after `tries` lookups a second apart (a
    passing DNS outage looks the same as none)."""
    for attempt in range(tries):
        try:
            socket.getaddrinfo(host, 443)
            return
        except socket.gaierror as e:
            failure = e
        if attempt < tries - 1:
            time.sleep(1)
    raise ConnectionError(f"cannot resolve {host}: {failure.strerror}")


def first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def name_some(names: list, shown: int = 3) -> str:
    """The first few names and a count: a message stays short whatever N is."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} file{'s' if len(names) != 1 else ''}: {', '.join(names[:shown])}{more}"


def unreachable_message(name: str, missing: list, out_dir: str, e: Exception) -> str:
    connect = ("HF_HUB_OFFLINE is set: unset it" if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false")
               else "Connect to the internet (or set HF_ENDPOINT to a reachable mirror)")
    out_dir = os.path.abspath(out_dir)
    return (f"could not download {name} from the Hugging Face dataset repo {REPO_ID} ({first_line(e)}).\n"
            f"Missing in {out_dir}: {name_some(missing)}.\n"
            f"{connect} and run again, or copy those shards into {out_dir}.")


def count_error(n: int) -> str:
    return (f"N is {n}, but {REPO_ID} has train shards 1..{TRAIN_SHARDS} (100M tokens each): "
            f"give N from 0 to {TRAIN_SHARDS}")


def token_count(path: str):
    """A valid shard's token count; None for a file that is no valid shard."""
    try:
        return read_header(path)
    except ShardError:
        return None


def download_shards(n: int, out_dir: str = DEFAULT_OUT, download=hf_download, log=print) -> list:
    """Make sure the val shard and train shards 1..n exist and are valid; returns the bad files' errors.
    Raises HubUnreachable (with what is missing and what to do) when the hub cannot be reached or the
    connection breaks, OutputError when out_dir cannot be written, OSError when a write fails (full disk)."""
    if not 0 <= n <= TRAIN_SHARDS:
        raise ValueError(count_error(n))
    output_folder(out_dir)
    names = shard_names(n)
    problems, no_answer = [], transport_errors()
    for i, name in enumerate(names, 1):
        path = os.path.join(out_dir, name)
        tokens = token_count(path) if os.path.exists(path) else None
        if tokens is not None:
            odd = tokens != SHARD_TOKENS and name != f"fineweb_train_{TRAIN_SHARDS:06d}.bin"
            log(f"[{i}/{len(names)}] {name}: present, valid" + (
                f"; note: {tokens:,} tokens where {REPO_ID}'s hold {SHARD_TOKENS:,}: a shard of your own under "
                f"FineWeb's name? (it is used as it is)" if odd else ""))
            continue
        if os.path.exists(path):
            log(f"[{i}/{len(names)}] {name}: present but invalid, moved to {set_aside(path)}; downloading again")
        log(f"[{i}/{len(names)}] {name}: downloading from {REPO_ID}")
        try:
            path = download(name, out_dir)
        except (HfHubHTTPError, *no_answer) as e:
            answer = hub_answer(e)  # the hub answered, with an error: no such file, no access, server trouble
            if answer is None:  # no answer, or the connection broke or stalled mid-file
                missing = [m for m in names[i - 1:] if not os.path.exists(os.path.join(out_dir, m))]
                raise HubUnreachable(unreachable_message(name, missing, out_dir, e)) from None
            problems.append(f"{name}: the hub {REPO_ID} answered: {first_line(answer)}")
            log(f"[{i}/{len(names)}] {name}: FAILED: {first_line(answer)}")
            continue
        try:
            read_header(path)
        except ShardError as e:
            bad = set_aside(path)
            problems.append(f"{e} (moved to {bad})")
            log(f"[{i}/{len(names)}] {name}: INVALID: {e}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("n", type=int, help=f"number of train shards (100M tokens each), 0..{TRAIN_SHARDS}")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for the shards, relative to the current folder (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    if not 0 <= args.n <= TRAIN_SHARDS:
        parser.error(count_error(args.n))
    try:
        problems = download_shards(args.n, args.out)
    except (HubUnreachable, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a write failed: a full disk, the folder made read-only meanwhile
        print(f"error: {write_failure(e, args.out, kept=True)}", file=sys.stderr)
        return 2
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    if not problems:
        print(f"{args.n + 1} valid shards in {os.path.abspath(args.out)}")
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback
        print("interrupted: the shards finished so far stay (a rerun skips them)", file=sys.stderr)
        sys.exit(130)
