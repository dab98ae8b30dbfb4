#!/usr/bin/env bash
# The GPU session's measurements (issue 34), one piece per process, each under `timeout`, all output
# kept in $OUT (default ./gpu-out): run from the repository root on the GPU machine, which has
# python3 with jax and no network. A session has 15 minutes of device time (a machine's start
# included) and a call at most 10: the script keeps to BUDGET_S seconds (default 540) in all, cutting
# each piece's limit to what is left and skipping a piece when under 45 s are, and it packs what the
# pieces wrote into one $OUT/pieces_DATE_TIME.tar.gz beside $OUT/session.txt (a call brings back at
# most 8 files).
# The compile caches below ("the call's") live for one run of this script, empty at its start and
# removed at its end: a piece reuses only what an earlier piece of the same run compiled. With
# GPU_SESSION_CACHES=DIR (an absolute path: the script works from the repository root) they live in
# DIR instead, kept at the end, so that a later run with other XLA_FLAGS (other programs, compiled
# again) finds XLA's autotuning results and kernels there; "this call's cache" below is then DIR's,
# empty only if DIR was.
#
#   HEAD=pallas DC=pallas OUT=$OUT/a BUDGET_S=300 tests/gpu/session.sh short-pallas profile-pallas
#                          # call 1 (timeout_s 340): the short run with the Pallas head, whose e5m2 gradient
#                          # was written out of bounds at 49,152-row chunks (the loss NaN at step 20, an H200,
#                          # 2026-11-27; i64 offsets since, not yet run on a GPU): it must reach its end (val_loss
#                          # near 1.3234, XLA's head's), and head_grad is profiled against its 19.8 ms a step;
#                          # on an H100 the goal's measurement too (490K tokens/s; none has ended yet); the
#                          # first run of the DC correction's Pallas kernels too (2026-11-28; auto takes XLA's
#                          # until then; a fault there: the lane's dc case, fault.py names dc_fwd, dc_dq or dc_dkv)
#   OUT=$OUT/l BUDGET_S=260 tests/gpu/session.sh lane
#                          # call 2 at once (status first; BUDGET_S at most budget_left_s - 40): the lane, its
#                          # head case the one that faulted (over 175 s on an H200 on 2026-11-27, its train case
#                          # past its case limit while compiling; 85 s before), each case's numbers kept; its dc
#                          # case the DC correction's kernels against the XLA path
#   OUT=$OUT/n BUDGET_S=170 tests/gpu/session.sh ncu
#                          # call 3 if call 1 ran to its end (budget_left_s - 40 at most): the Pallas kernels'
#                          # hardware counters, why attention runs at 11-17% of the tensor cores and mlp_up
#                          # at half of cuBLAS's FP8 rate (the first ncu run of this code: if it fails at once,
#                          # the call's rest goes to call 4)
#   DC=pallas OUT=$OUT/x BUDGET_S=130 tests/gpu/session.sh short-pallas
#                          # call 3 instead if call 1 did not end (an H100: 160): today's default head, XLA's
#                          # (its passes with fewer instructions since 2026-11-28), against call 1's Pallas head
#                          # in the same session, with call 1's DC kernels (the head the one difference; a fault
#                          # here too points at the DC kernels; all three calls run matmul's bf16 GEMM outputs
#                          # and the head GEMM's bf16 logits for the first time: tests/gpu/README.md)
#   SWEEP=up:128x256x128/8/3,up:128x128x128/8/3,up:256x128x128/8/3,dpre:128x256x64/8/3,dpre:128x128x64/8/3,dq:64/8/2,dq:64/8/3,dkv:64/8/4,dc:16/4/1,dc:16/8/1 OUT=$OUT/s BUDGET_S=150 \
#       tests/gpu/session.sh sweep
#                          # call 4 if budget_left_s - 40 holds it: the MLP kernels' tiles, the reference's against
#                          # 128 x 128, whose registers let two programs share a multiprocessor (tests/gpu/aot.py
#                          # --sweep), the attention backward's stages (64/8/3, 64/8/4 fastest once, 2026-11-27)
#                          # and the DC correction's kernels at 4 and 8 warps (never run on a GPU yet)
#   MLP=xla HEAD=xla XLA_FLAGS=--xla_gpu_enable_command_buffer= OUT=$OUT/nocmdbuf tests/gpu/session.sh short-xla
#                                                     # bisecting a crash: the environment passes through
#
# Pieces:
#   lane            python3 -m pytest -v -n 4 tests/test_gpu.py: the cases in 4 processes at once
#                   (GPU_LANE_WORKERS; 2026-11-26, one at a time, the lane did not fit 245 s), each case's
#                   numbers in lane-results.jsonl as it ends (GPU_LANE_RESULTS), each case's
#                   child process under GPU_LANE_TIMEOUT (default: 420 s, or 30 s less than the piece has)
#                   and without preallocating the GPU's memory, a line per test as it ends and a failure's
#                   reason at once (FAILURES_AT_ONCE, tests/conftest.py), not only in the summary a limit
#                   cuts off                                           (limit 540 s, or what is left)
#   short-IMPL      the short run of train_gpt.py with --attention IMPL (xla, pallas; --dc, --mlp and
#                   --head from DC, MLP and HEAD, default auto: on a GPU train_gpt.AUTO_ON_GPU's, so
#                   MLP=xla HEAD=xla short-xla is the all-XLA run): the record
#                   preset, 27 + 3 steps (every stage shape: stages at 0, 9, 18, 27), validations at
#                   steps 0, 10, 20 on the first 2,097,152 tokens (one validation step of the record's
#                   val program, the smallest its batch allows; the issue's "1M") and at the end on
#                   the full 10,485,760; it compiles cold, into this call's empty cache for IMPL
#                   (its log's compile line says "0 of 4 loaded from it")                 (limit 360 s)
#   crash-IMPL      short-IMPL compiled cold with XLA's dumps of the optimized programs, the driver
#                   writing a CUDA core dump at a device fault (and ending the process: the log's
#                   stopped line is short-IMPL's to show); then tests/gpu/fault.py names the
#                   faulting kernel (cuda-gdb) and prints its HLO instruction. Into IMPL's cache of
#                   the call while it is empty (profile-IMPL after it loads from there), else into
#                   a fresh one                                                   (limit 360 s + 120 s)
#   short-record20  the record-20 archive's short run: 30 steps, validation at the end    (limit 360 s)
#   profile-IMPL    python3 bench.py --profile TMP --attention IMPL: the last stage's train program
#                   alone, its top device ops and source lines, in profile-IMPL.txt; after short-IMPL
#                   (or crash-IMPL) in the same session.sh run, or in one before it with the same
#                   GPU_SESSION_CACHES and XLA_FLAGS, it loads that program from the cache that piece
#                   filled, instead of compiling it again (its header says which)        (limit 300 s)
#   bench           python3 bench.py --suite --profile TMP --attention pallas --compile-cache-dir
#                   CACHE: the table in bench.txt; CACHE is the call's pallas cache (after short-pallas:
#                   its programs loaded, not compiled again; the compile line says how many) (limit 540 s)
#   sweep           python3 bench.py --sweep $SWEEP: the Pallas kernels' tiles, warps and stages at
#                   the record's last-stage chunk (attention's, the MLP's, the DC correction's), a row each, the median of
#                   3 rounds (every row timed once a round), in sweep.txt
#                   (default: SWEEP_DEFAULT below)                                        (limit 540 s)
#   ncu             Nsight Compute's counters of the Pallas kernels at their defaults (NCU_SWEEP, below)
#                   and the record's last-stage chunk: bench.py --sweep NCU_SWEEP, one call each, under
#                   ncu (NCU: its path) with --clock-control none, XLA's command buffers off, kernels
#                   matching ^(attention_|mlp_|dc_), their first 30 launches (the sweep makes 23: two
#                   calls a row, the attention rows at two windows, dq's after one forward): where each
#                   kernel's time goes (speed of light, pipes, occupancy, warp stalls, instruction mix), which the profile's
#                   times cannot say (attention at 11-17% of the tensor cores, mlp_up at about half of
#                   cuBLAS's FP8 rate); the report in ncu.ncu-rep, its details page as text in
#                   ncu-page.log                                                 (limit 240 s + 60 s)
# The short runs read synthetic shards with FineWeb-like documents and vocabulary (data/synthetic.py
# --mean-doc-len 1000 --vocab 50257: 20M train tokens and a full 10,485,762-token val shard), written
# once per session into a fresh temporary folder. Their numbers: the summary line (step_avg,
# tokens_per_s, compile_s) of the record logs in rec/ of the packed output, and each stage's step time
# (records/logs.py, printed into session.txt after the run). DC, MLP and HEAD (auto, xla, pallas) give
# the short runs, the profiles and the bench suite --dc, --mlp and --head (default auto: on a GPU
# train_gpt.AUTO_ON_GPU's, XLA's DC correction, the Pallas MLP and XLA's head; pallas: the Pallas
# kernels; xla: XLA's GEMMs and passes).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then  # the comment above, as usage
    sed -n '2,/^set -uo/p' "$0" | grep '^#' | cut -c3-
    exit 0
fi
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DATA=${GPU_SESSION_DATA:-}
DC=${DC:-auto} MLP=${MLP:-auto} HEAD=${HEAD:-auto}  # train_gpt.py's, bench.py's --dc, --mlp, --head: short runs, profiles, bench
# the kernels' defaults (fwd 128/8/2, dq and dkv 64/8/2) and neighbours that compile for an H100 without
# register spills (tests/gpu/aot.py --sweep, 2026-11-25: every 4-warp configuration but fwd 32/4 spills, so
# does dkv 128/8; tile 128 with 3-4 stages (fwd: 4) exceeds the shared memory)
# and the MLP's GEMM kernels' defaults (up 128x256x128/8/3, dpre 128x256x64/8/3: the reference's) and
# neighbours, all clean for an H100 (up since its FP8 dot accumulates into the loop's sum, 2026-11-27:
# 128x256 and 256x128 spilled before; up's old default 128x128x128/8/3 among them; dpre as on 2026-11-26, and
# 128x128x64/8/3, whose registers leave room for two programs a multiprocessor, since 2026-11-28), and the
# DC correction's kernels at 4 warps (the default) and 8: neither spills (2026-11-28)
SWEEP_DEFAULT=fwd:128/8/2,fwd:128/8/3,fwd:64/8/3,fwd:64/8/4,dq:64/8/2,dq:64/8/3,dq:128/8/2,dq:32/8/3,dkv:64/8/2,dkv:64/8/3,dkv:64/8/4,dkv:32/8/3
SWEEP_DEFAULT+=,up:128x256x128/8/3,up:128x256x128/8/4,up:256x128x128/8/3,up:128x128x128/8/3,up:128x128x128/8/4
SWEEP_DEFAULT+=,dpre:128x256x64/8/3,dpre:128x256x64/8/4,dpre:128x128x64/4/4,dpre:128x128x64/8/3,dpre:128x256x32/8/4
SWEEP_DEFAULT+=,dc:16/4/1,dc:16/8/1
# the kernels' defaults (train_gpt.PALLAS_FWD, _DQ with _DKV, _MLP_UP, _MLP_DPRE, _DC; a test checks them)
NCU_SWEEP=${NCU_SWEEP:-fwd:128/8/2,dq:64/8/2,up:128x256x128/8/3,dpre:128x256x64/8/3,dc:16/4/1}
# ncu: NCU, else on PATH, else the newest under /opt/nvidia/nsight-compute (the image's)
NCU=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)}
BUDGET_S=${BUDGET_S:-540}
PACKING_S=25  # kept back for a piece's kill (timeout -k 10) and the packing
PIECES="lane short-xla short-pallas crash-xla crash-pallas short-record20 profile-xla profile-pallas bench sweep ncu"
if ! [[ " auto xla pallas " == *" $DC "* && " auto xla pallas " == *" $MLP "* && " auto xla pallas " == *" $HEAD "* ]]; then
    echo "tests/gpu/session.sh: DC=$DC MLP=$MLP HEAD=$HEAD: choose auto, xla or pallas for each" \
         "(train_gpt.py --dc, --mlp, --head)" >&2
    exit 2
fi
if ! [[ "$BUDGET_S" =~ ^[0-9]+$ ]]; then
    echo "tests/gpu/session.sh: BUDGET_S=$BUDGET_S: give whole seconds, e.g. BUDGET_S=540" >&2
    exit 2
fi
for p in "$@"; do  # every name checked before anything runs
    if ! [[ " $PIECES " == *" $p "* && "$p" =~ ^[a-z0-9-]+$ ]]; then
        echo "tests/gpu/session.sh: unknown piece '$p' (pieces: $PIECES)" >&2
        exit 2
    fi
done
RUN=$(mktemp -d "$OUT/run.XXXXXX")  # what this call's pieces write, packed at the end
CACHES=${GPU_SESSION_CACHES:-$(mktemp -d)}  # this call's compile caches, one per attention implementation
mkdir -p "$CACHES" || exit 2
status=0

say() { echo "$*" | tee -a "$OUT/session.txt"; }

piece() {  # piece NAME LIMIT_S COMMAND...: run it, keep its whole output, say how it ended
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - SECONDS - PACKING_S))
    if [ "$left" -lt 45 ]; then
        say "== $name: skipped, ${left}s of BUDGET_S=${BUDGET_S} left"
        status=1
        return
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    say "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$RUN/$name.log" 2>&1
    local rc=$?
    [ "$rc" = 124 ] && say "== $name: timed out after ${limit}s"
    [ "$rc" = 137 ] && say "== $name: killed (after ${limit}s and 10 more, or out of memory)"
    say "== $name: exit $rc"
    tail -n 15 "$RUN/$name.log" | tee -a "$OUT/session.txt"
    [ "$rc" = 0 ] || status=1
}

shards() {  # the short runs' data, written once
    if [ -z "$DATA" ]; then
        DATA=$(mktemp -d)
        piece synthetic 300 "$PY" data/synthetic.py --out "$DATA" --train-tokens 20000000 --val-tokens 10485762 \
            --mean-doc-len 1000 --vocab 50257
    fi
}

stage_times() {  # the newest record log's end and step time by stage (records/logs.py), into the summary
    local log
    log=$(ls -t "$RUN"/rec/*.txt 2>/dev/null | head -n 1)
    [ -n "$log" ] && "$PY" records/logs.py "$log" 2>&1 | tee -a "$OUT/session.txt"
}

short() {  # short IMPL CACHE_DIR: SHORT becomes the short run's command
    SHORT=("$PY" train_gpt.py --preset record --attention "$1" --dc "$DC" --mlp "$MLP" --head "$HEAD"
           --train-files "$DATA/synthetic_train_*.bin" --val-files "$DATA/synthetic_val_*.bin"
           --num-scheduled-iterations 27 --num-extension-iterations 3 --val-loss-every 10
           --intermediate-val-tokens 2097152 --records-dir "$RUN/rec" --compile-cache-dir "$2")
}

for p in "$@"; do
    case "$p" in
        lane)  # the cases side by side: each compiles on a few cores and barely loads the GPU (session_script
            # runs this script); a case's own limit ends before the piece's, so that a slow case fails alone
            case_s=$((BUDGET_S - SECONDS - PACKING_S - 30))
            [ "$case_s" -gt 420 ] && case_s=420
            piece lane 540 env GPU_LANE_TIMEOUT="${GPU_LANE_TIMEOUT:-$case_s}" FAILURES_AT_ONCE=1 \
                GPU_LANE_RESULTS="$RUN/lane-results.jsonl" "$PY" -m pytest -v \
                -rfE --tb=short -n "${GPU_LANE_WORKERS:-4}" tests/test_gpu.py -k "not session_script" ;;
        short-xla|short-pallas)
            shards
            short "${p#short-}" "$CACHES/${p#short-}"
            piece "$p" 360 "${SHORT[@]}"
            stage_times ;;
        crash-xla|crash-pallas)  # compiles cold, so that XLA dumps the programs
            shards
            dump=$(mktemp -d) cache="$CACHES/${p#crash-}"
            [ -n "$(ls -A "$cache" 2>/dev/null)" ] && cache=$(mktemp -d "$CACHES/crash.XXXXXX")
            short "${p#crash-}" "$cache"
            piece "$p" 360 env CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1 CUDA_ENABLE_LIGHTWEIGHT_COREDUMP=1 \
                CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION=0 CUDA_COREDUMP_FILE="$dump/core.%p" \
                XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump/xla --xla_dump_hlo_as_text" "${SHORT[@]}"
            stage_times
            piece "$p-fault" 120 "$PY" tests/gpu/fault.py "$dump" ;;
        short-record20)
            shards
            piece "$p" 360 "$PY" records/record20/train_gpt.py --preset record --num-iterations 30 --val-loss-every 0 \
                --train-files "$DATA/synthetic_train_*.bin" --val-files "$DATA/synthetic_val_*.bin" \
                --records-dir "$RUN/rec" --compile-cache-dir ""
            stage_times ;;
        # the tables keep the profile's top ops and lines; the raw trace (tens of MB) stays on the machine
        profile-xla|profile-pallas)
            piece "$p" 300 "$PY" bench.py --profile "$(mktemp -d)/trace" --attention "${p#profile-}" --dc "$DC" \
                --mlp "$MLP" --head "$HEAD" --compile-cache-dir "$CACHES/${p#profile-}" --out "$RUN/$p.txt" ;;
        bench) piece bench 540 "$PY" bench.py --suite --profile "$(mktemp -d)/trace" --attention pallas --dc "$DC" \
            --mlp "$MLP" --head "$HEAD" --compile-cache-dir "$CACHES/pallas" --out "$RUN/bench.txt" ;;
        sweep) piece sweep 540 "$PY" bench.py --sweep "${SWEEP:-$SWEEP_DEFAULT}" --out "$RUN/sweep.txt" ;;
        ncu)  # the counters replay each kernel many times: one call each, unpreallocated memory for the replays
            piece ncu 240 env XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
                "${NCU:-ncu}" --clock-control none -k "regex:^(attention_|mlp_|dc_)" --launch-count 30 \
                --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
                --section InstructionStats --export "$RUN/ncu" --force-overwrite \
                "$PY" bench.py --sweep "$NCU_SWEEP" --repeats 1 --rounds 1 --out "$RUN/ncu-sweep.txt"
            [ -f "$RUN/ncu.ncu-rep" ] && piece ncu-page 60 "${NCU:-ncu}" --import "$RUN/ncu.ncu-rep" --page details ;;
    esac
done
# what this call's pieces wrote in one file (a device call brings back at most 8), under a new name
pack=pieces_$(date -u +%Y%m%d_%H%M%S).tar.gz
[ -e "$OUT/$pack" ] && pack=pieces_$(date -u +%Y%m%d_%H%M%S)_$$.tar.gz
[ -n "${GPU_SESSION_CACHES:-}" ] || rm -rf "$CACHES"
if tar -czf "$OUT/$pack" -C "$RUN" . && rm -rf "$RUN"; then
    say "== the pieces' output: $OUT/$pack ($(date -u +%H:%M:%S), ${SECONDS}s of BUDGET_S=${BUDGET_S})"
else
    say "== packing failed: the pieces' output is in $RUN"
    status=1
fi
exit $status
