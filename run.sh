#!/usr/bin/env bash
# The speedrun on this machine, from nothing (usage below). Set-up: a virtual environment in .venv
# (unless one is active), requirements.txt, and the CUDA build of jax when nvidia-smi lists GPUs.
# Data: FineWeb shards from data/cached_fineweb10B.py; on a machine without GPUs where they cannot
# be downloaded, synthetic shards (said loudly).
# Multi-host: run this script once per process with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
# and JAX_PROCESS_ID set (or under SLURM / Open MPI); see README.md.
set -euo pipefail
# Relative paths (data/..., the data tools' default folders) then mean the repository's, from anywhere.
cd "$(dirname "$0")"

help=0
attempt=0  # --runs N: a record attempt, handed to records/attempt.py
own_train=0  # --train-files and --val-files both given: the user's data, so run.sh gets none
own_val=0
check_only=0  # --check: the options checked, nothing else
script=train_gpt.py  # --script PATH: another training script (a copy, or records/record20/train_gpt.py)
if [ "${1:-}" != "test" ]; then  # ./run.sh test --help is pytest's help
    previous=""
    rest=()  # the options without --script: what a single run passes on to the script
    for arg in "$@"; do
        case "$arg" in
            -h|--help) help=1 ;;
            --runs|--runs=*) attempt=1 ;;
            --train-files|--train-files=*) own_train=1 ;;
            --val-files|--val-files=*) own_val=1 ;;
            --check) check_only=1 ;;
        esac
        case "$previous/$arg" in
            --script/*) script="$arg" ;;
            */--script) ;;
            */--script=*) script="${arg#--script=}" ;;
            *) rest+=("$arg") ;;
        esac
        previous="$arg"
    done
    if [ "$previous" = --script ] || [ -z "$script" ]; then
        echo "run.sh: --script needs a path, e.g. --script my_attempt.py" >&2
        exit 2
    fi
    if [ ! -f "$script" ]; then
        echo "run.sh: --script $script: no such file (relative paths start at $(pwd))" >&2
        exit 2
    fi
    if [ "$attempt" = 0 ]; then  # a record attempt hands --script to records/attempt.py instead
        set -- ${rest[@]+"${rest[@]}"}
    fi
fi
if [ "$help" = 1 ]; then  # printed before set-up; help never downloads or writes shards
    cat <<'EOF'
usage: ./run.sh [--script PATH] [train_gpt.py options]
                                         set up, make sure data exists, train on all local devices
                                         (--script: another training script, e.g. your copy or
                                         records/record20/train_gpt.py)
       ./run.sh --runs N [--seed S] [--script COPY.py] [--against LOGS...] [train_gpt.py options]
                                         a record attempt: N seeded runs, then the statistical
                                         verdict (python records/attempt.py --help says more)
       ./run.sh test [pytest options]    set up, run the test suite (offline)
       ./run.sh --help                   this text, then train_gpt.py's options

Set-up: .venv (unless a virtual environment is active) with requirements.txt, plus the CUDA build
of jax when nvidia-smi lists GPUs. Data: on GPUs, the FineWeb val shard and 8 train shards in
data/fineweb10B; without GPUs, the val shard and 1 train shard, or synthetic shards in data/synthetic
when FineWeb cannot be downloaded; none when --train-files and --val-files name your own; with one
of them, FineWeb's for the other half (never synthetic shards mixed with yours). The options are
checked before any data work (--check: only that). run.sh works in its own folder: relative paths
in options start there.

EOF
fi

# Processes started at once on one machine (one per GPU under SLURM, or two by hand: README.md) set up
# and get data one at a time: two pip installs into one environment at once can break it. (Released
# before anything else runs: fd 9 closed. Where no lock can be had, it goes on without.)
if command -v flock >/dev/null 2>&1; then
    if ! { exec 9>>.run_sh.lock; } 2>/dev/null; then
        echo "run.sh: cannot open $(pwd)/.run_sh.lock: setting up without waiting for other run.sh processes" >&2
    elif ! flock -n 9; then
        echo "run.sh: another run.sh in $(pwd) is setting up or getting data: waiting for it ..." >&2
        flock 9 || echo "run.sh: cannot lock $(pwd)/.run_sh.lock (no locks on this file system?): going on" >&2
    fi
fi
if [ -z "${VIRTUAL_ENV:-}" ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi
pip_once() {  # pip install ARGS, unless this environment already got exactly these (a stamp in its folder,
    # named by a hash of the Python version, the arguments and the files they name): ~2 s saved a call.
    # (Not --no-compile, although the bytecode takes 31 of the 54 s of a fresh install on 2 cores: with
    # PYTHONDONTWRITEBYTECODE set, as on the CI machine, every process would then compile every import:
    # the suite took 994 s of CPU instead of 834)
    local key
    key=$( (python -V 2>&1; printf '%s\n' "$@"; for arg in "$@"; do if [ -f "$arg" ]; then cat "$arg"; fi; done) |
          sha256sum | cut -c1-16)
    if [ ! -e "$VIRTUAL_ENV/.run_sh_pip_$key" ]; then
        echo "run.sh: pip install $* into $VIRTUAL_ENV (again only when those files change; a minute or so the first time)" >&2
        python -m pip install -q --disable-pip-version-check "$@"
        touch "$VIRTUAL_ENV/.run_sh_pip_$key"
    fi
}
pip_once -r requirements.txt
if [ "$help" = 1 ]; then
    exec 9>&-
fi
if [ "$help" = 1 ] && [ "$attempt" = 1 ]; then
    exec python records/attempt.py --help
elif [ "$help" = 1 ]; then
    exec python "$script" --help  # needs the packages, not the data
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "$gpus" -gt 0 ]; then
    jax_version=$(python -c 'import jax; print(jax.__version__)')
    pip_once "jax[cuda12]==${jax_version}"
fi

if [ "${1:-}" = "test" ]; then
    shift
    pip_once -r tests/requirements.txt
    export HF_HUB_OFFLINE=1
    exec 9>&-
    exec python -m pytest -q -n 2 --dist load --maxschedchunk 1 tests "$@"  # two workers (tests/requirements.txt says why);
    # load, one test at a time: the tests in order (the heavy ones first: conftest) to the workers as
    # they free up (each keeps one queued), so that no long test ends alone
fi
# bad options exit 2 here, before any data work: the attempt's, and the script's when it can check
# them (train_gpt.py and copies of it: --check), asked as records/attempt.py asks it
if [ "$attempt" = 1 ]; then
    python records/attempt.py --check "$@"
else
    python -c 'import sys; from records.attempt import script_check; sys.exit(script_check(sys.argv[1], sys.argv[2:]))' \
        "$script" "$@"
fi
if [ "$check_only" = 1 ]; then
    if python -c 'import sys; from records.attempt import has_check; sys.exit(not has_check(sys.argv[1]))' \
            "$script"; then
        echo "run.sh --check: no problem found in the options (shards and weight files are read when a run starts)"
    fi
    exit 0
fi

data_flags=()
# record 89 reads 339M tokens (410M of shards: BOS-aligned batches skip to the next shard); record 20's
# archive 730M: 8 train shards of 100M tokens serve both on GPUs; one shows that the pipeline trains
train_shards=$([ "$gpus" -gt 0 ] && echo 8 || echo 1)
alone=""  # the one data flag given without the other: FineWeb supplies the other half, never synthetic shards
if [ "$own_train" = 1 ] && [ "$own_val" = 0 ]; then
    alone=--train-files
    train_shards=0  # the val shard alone
elif [ "$own_val" = 1 ] && [ "$own_train" = 0 ]; then
    alone=--val-files
fi
if [ "$own_train" = 1 ] && [ "$own_val" = 1 ]; then
    echo "run.sh: --train-files/--val-files given: no data downloaded or generated"
elif [ -n "$alone" ]; then
    echo "run.sh: $alone given alone: FineWeb's shards for the other half (data/cached_fineweb10B.py" \
         "$train_shards, which also gets the val shard)"
    if ! python data/cached_fineweb10B.py "$train_shards"; then
        echo "run.sh: FineWeb could not be downloaded for the half that $alone leaves open, and synthetic shards" \
             "mixed with yours would measure nothing: give both --train-files and --val-files, or neither" >&2
        exit 2
    fi
elif [ "$gpus" -gt 0 ]; then
    python data/cached_fineweb10B.py "$train_shards"
elif ! python data/cached_fineweb10B.py "$train_shards"; then
    cat <<'EOF'
################################################################################
#  FineWeb could not be downloaded (the error above says why, and how to get   #
#  it), and this machine has no GPU: this run goes on, but it is training on   #
#  SYNTHETIC shards (data/synthetic/). Its losses say nothing about FineWeb;   #
#  they only show that the pipeline trains.                                    #
################################################################################
EOF
    # synthetic.py writes the val shard last, so it marks a complete set. Without it, synthetic.py
    # writes a set, or stops (exit 2, naming the files) when data/synthetic holds part of one.
    if [ ! -e data/synthetic/synthetic_val_000000.bin ]; then
        python data/synthetic.py --out data/synthetic
    fi
    data_flags=(--train-files 'data/synthetic/synthetic_train_*.bin' --val-files 'data/synthetic/synthetic_val_*.bin')
fi

exec 9>&-
if [ "$attempt" = 1 ]; then
    exec python records/attempt.py "${data_flags[@]}" "$@"
fi
exec python "$script" "${data_flags[@]}" "$@"
