"""Compile the record's programs for an H100 on a machine without a GPU (issue 34's CPU preparation).

XLA compiles for a GPU it does not have through a compile-only topology: the GPU compiler runs whole
(fusion, buffer assignment, Triton for the Pallas kernels), without autotuning, so GEMMs get the
compiler's default choices, not the fastest; with train_gpt's XLA_FLAG_DEFAULTS, as a training run,
XLA's GEMMs are cuBLAS calls. Without a GPU this shows:

  programs  every train program (one per stage shape) and the validation program of the record
            preset, per attention implementation, compile for sm_90: compile seconds (on this
            machine's cores), XLA's memory (arguments + temporaries) against the H100's 80 GB, and
            for each train program the GPU lane's FP8 check (tests/test_gpu.py: every head matmul
            and the 22 MLP projections are FP8 GEMMs; the head writes no array of its logits' size
            but the GEMM's bf16 logits and the gradient, with --head pallas also its sigmoids;
            validation's, none but the GEMM's),
            the kernels ptxas says spill registers, and
            (--traffic N) a static estimate of a step's memory traffic, GEMM FLOPs and XLA's kernels'
            instructions with its N costliest source lines: it ranks costs, it is no timing;
  --devices the same for the programs of 2, 4 or 8 H100s of one machine (8: the record's, one chunk
            per device): one device's memory and estimate, with the bytes it sends to the others
            in collectives (the gradients' reduce-scatters, the new parameters' all-gathers);
  --sweep   which Pallas kernel configurations (bench.py --sweep syntax) fit the H100's shared memory
            and registers at the record's last stage, so that a GPU session times only those, and
            which tensor-core instructions each got (its PTX: Hopper's wgmma, or Ampere's mma.sync), its
            registers (ptxas -v) and how many of its programs they leave room for on a multiprocessor; with
            --ptx-blocks also its PTX's basic blocks and branches (a loop step's instructions on each path);
  --head-ptx the training head's forward alone (--head's: the FP8 GEMM, the normaliser's and the
            gradient's passes over the logits) at the last stage's chunk: each kernel's PTX
            instructions and exponentials (ex2), from which a logit's: XLA's gradient pass moved 3
            bytes a logit at 1.0 TB/s on an H200 (2026-11-27), bound by its instructions, not memory.

It needs JAX's CUDA plugin, which is no dependency of the project (4.6 GB): in its own environment,

    python3.12 -m venv /tmp/vcuda && /tmp/vcuda/bin/pip install -r requirements.txt "jax[cuda13]==0.11.2" pytest
    /tmp/vcuda/bin/python tests/gpu/aot.py [--attention xla,pallas] [--dc xla|pallas] [--programs all|last] [--devices N] [--sweep CONFIGS [--ptx-blocks]] [--head-ptx]
"""
import argparse
import atexit
import contextlib
import dataclasses
import glob
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

PTX_DIR = None  # where XLA writes each compiled module's PTX and thunk sequence (the kernels' launches)
if __name__ == "__main__":  # (imported, by the tests, it leaves the environment alone)
    os.environ["JAX_PLATFORMS"] = "cpu"  # compile-only: the CUDA plugin gives a topology, never a device
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # XLA logs ptxas's register-spill reports at INFO level
    if "xla_dump_to" not in os.environ.get("XLA_FLAGS", ""):  # (XLA_FLAGS naming a dump folder: none read)
        PTX_DIR = tempfile.mkdtemp(prefix="aot_ptx_")  # read before JAX starts: XLA reads its flags once
        atexit.register(shutil.rmtree, PTX_DIR, ignore_errors=True)
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={PTX_DIR} "
                                   "--xla_dump_emitter_re=ptx").strip()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import train_gpt as tg  # noqa: E402

if __name__ == "__main__":
    tg.backend_defaults()  # compiled with the XLA flags a training run starts with (before JAX reads them)
from bench import dc_forward_backward, kernels_named, parse_sweep, source_of, tuning_name  # noqa: E402

INSTALL = 'python3.12 -m venv /tmp/vcuda && /tmp/vcuda/bin/pip install -r requirements.txt "jax[cuda13]==0.11.2" pytest'
try:  # the GPU lane's HLO readers; their module imports pytest
    from test_gpu import (beyond_the_head, dims, element_type, fp32_activations, fp8_gemm_problems,  # noqa: E402
                          fp8_mlp_gemms, head_logit_passes, pallas_gemm, parse_hlo)
except ImportError as e:
    print(f"tests/gpu/aot.py: {e}; it runs in an environment of its own, with JAX's CUDA plugin and pytest:\n"
          f"  {INSTALL}", file=sys.stderr)
    raise SystemExit(2) from None

# An H100 SXM 80GB as XLA's GpuTargetConfig describes a device (the figures CUDA reports for it:
# 132 SMs, 228 KiB shared memory per SM of which 227 KiB to one block, 50 MiB L2, 81,559 MiB).
H100_MEMORY = 81559 * 2**20
H100 = f"""
gpu_device_info {{
  cuda_compute_capability {{ major: 9 minor: 0 }}
  core_count: 132
  fpus_per_core: 128
  threads_per_warp: 32
  threads_per_block_limit: 1024
  threads_per_core_limit: 2048
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  l2_cache_size: 52428800
  memory_bandwidth: 3352000000000
  clock_rate_ghz: 1.98
  device_memory_size: {H100_MEMORY}
}}
platform_name: "CUDA"
runtime_version {{ major: 13 minor: 0 }}
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "NVIDIA H100 80GB HBM3"
"""
GIB = 2**30


def h100_mesh(devices: int = 1):
    """A mesh of `devices` compile-only H100s of one machine (the record's 8: one chunk each)."""
    from jax.experimental import topologies
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=H100, topology=f"1x1x{devices}")
    except Exception as e:  # noqa: BLE001  (whatever the missing plugin raises, the fix is the same)
        print(f"tests/gpu/aot.py: this Python has no compile-only CUDA topology ({type(e).__name__}: {str(e)[:200]}).\n"
              f"It needs JAX's CUDA plugin beside jax {jax.__version__}; install both in an environment of "
              f"their own:\n  {INSTALL}", file=sys.stderr)
        raise SystemExit(2) from None
    return tg.make_mesh(topology.devices)


def abstract(x, sharding):
    """The shape and dtype of an array or a numpy scalar, placed by `sharding`."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=sharding)


@contextlib.contextmanager
def ptxas_notes(notes: list):
    """Collect (kernel, note) for what ptxas says of register spills and serialized wgmma while
    compiling (XLA's C++ log writes to file descriptor 2; everything else it logs there is dropped)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            for line in log:
                spill = re.search(r"spilled to local memory in function '([^']+)', (\d+) bytes spill stores, "
                                  r"(\d+) bytes spill loads", line)
                serial = re.search(r"wgmma\S* instructions are serialized due to (.+?) (?:in|for) the function "
                                   r"'([^']+)'", line)
                if spill:
                    notes.append((spill[1], f"spills {spill[2]}/{spill[3]} bytes (stores/loads)"))
                elif serial:
                    notes.append((serial[2], f"wgmma serialized: {serial[1]}"))
                elif "ptxas" in line and re.search(r"\berror\b", line, re.I):
                    notes.append(("ptxas", line.strip()[:200]))


def record_programs(hp, mesh, which: str):
    """[(name, lowered program, tokens per chunk, is_train)] of the record preset, lowered by
    train_gpt's lower_steps (as
    train() lowers them) on abstract arguments: each stage shape's train program and the validation
    program, or only the last stage's train program."""
    rep, by_chunk = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    params = {k: jax.ShapeDtypeStruct(s, d, sharding=rep) for k, (s, d) in tg.param_shapes(hp).items()}
    weights = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in tg.buffer_shapes(hp).items()}
    buffers = {"bigram_sign_table": abstract(weights["bigram_sign_table"], rep)}
    opt_state = jax.tree.map(abstract, jax.eval_shape(lambda p: tg.init_optimizer_state(p, hp, mesh.size), params),
                             tg.optimizer_state_shardings(hp, mesh))
    fp8 = jax.eval_shape(tg.fp8_state, weights)  # its layout as train() gets it
    fp8 = {"next_w": abstract(fp8["next_w"], rep), "act": abstract(fp8["act"], by_chunk)}
    prefix_V = abstract(np.zeros(hp.padded_vocab, np.int32), rep)
    train, val = tg.lower_steps(hp, mesh, params, buffers, opt_state, fp8, prefix_V)
    programs = [(f"train chunk {T} mtp {mtp}", lowered, T, True) for (T, mtp), lowered in train.items()]
    if which == "last":
        return programs[-1:]
    val_chunk = hp.val_batch_size // tg.RANKS
    return programs + [(f"validation chunk {val_chunk}", val, val_chunk, False)]


# A static estimate of a step's memory traffic and GEMM work from the compiled HLO, for ranking costs
# without a GPU (not a timing): each top-level kernel moves its operands and results once (only the
# slices where a fusion reads slices of an operand, directly or through bitcasts, reshapes, converts and
# transposes, or updates a slice; the rows where it scatters into a buffer in place),
# loop bodies count their known trip counts, every branch of a conditional counts (so a train step's
# figures are an odd step's: Adam steps, and exchanges its gradients, inside a conditional; an even
# step's count none), and a custom call (a Pallas kernel) counts its operands, and FLOPs only where it
# is one of train_gpt's Pallas GEMM kernels. A collective among the devices counts the bytes each
# device sends over NVLink in a ring (all-reduce: 2(n-1)/n of its operand; all-gather and
# reduce-scatter: (n-1)/n of the whole; its HBM traffic is left out), at its start where it is
# asynchronous.
ELEMENT_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                 "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "u8": 1, "pred": 1, "token": 0}
# rates seen on the H100 machines here: a device-to-device copy ~3.0 TB/s, an 8192^3 bf16 product ~800 TFLOP/s
HBM_BYTES_PER_S, GEMM_FLOPS_PER_S = 3.0e12, 700e12
# NVLink between 8 H100 SXMs: an assumed rate, never measured here (no session has had more than one GPU);
# NCCL's all_reduce_perf reports a bus bandwidth of about this for large messages on such machines
NVLINK_BYTES_PER_S = 450e9
# an H100 SXM issues 4 warp instructions a cycle per SM: 132 SMs x 4 x 32 threads at 1.98 GHz, in thread
# instructions a second, the floor of a kernel bound by its instructions (PTX's, which ptxas may expand):
# XLA's head gradient pass moved 1.0 TB/s on an H200 (2026-11-27), its bytes' floor a fifth of its time
ISSUES_PER_S = 132 * 4 * 32 * 1.98e9
FREE_OPS = ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id")
# what each of a group's n devices sends, as a part of the collective's operand (all-gather's: the local
# share): a ring's for the all-reduce (NVLink SHARP may send less), reduce-scatter and all-gather
SENT_SHARE = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: n - 1,
              "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
              "collective-permute": lambda n: 1}


def group_size(ins, operand_bytes: int, result_bytes: int, devices: int) -> int:
    """The devices of one of a collective's groups: from its shapes where they tell (all-gather,
    reduce-scatter), else from its replica_groups ([G,N]<=[...] or {{a,b,...},...}), else `devices`."""
    op = ins.op.removesuffix("-start")
    if op == "all-gather" and operand_bytes:
        return round(result_bytes / operand_bytes)
    if op == "reduce-scatter" and result_bytes:
        return round(operand_bytes / result_bytes)
    groups = re.search(r"replica_groups=(?:\[\d+,(\d+)\]<=|\{\{([\d,]+)\})", ins.attrs)
    return (int(groups[1]) if groups[1] else len(groups[2].split(","))) if groups else devices


def type_bytes(type_: str) -> int:
    return sum(ELEMENT_BYTES.get(t, 4) * int(np.prod([int(d) for d in shape.split(",") if d]))
               for t, shape in re.findall(r"(\w+)\[([\d,]*)\]", type_))


def traffic(text: str, devices: int = 1, branches: bool = True, instructions: dict = None) -> tuple:
    """({source: [bytes, GEMM flops, kernel launches, bytes sent to other devices, thread instructions]},
    loops without a known trip count) of one run of the module's entry computation on one of `devices`
    devices; every conditional's branches counted, or (branches=False) none of them. instructions:
    {kernel_name: thread instructions of a launch} (thread_instructions')."""
    module, where = parse_hlo(text), source_of(text)
    rows, unknown = {}, []
    typ = lambda comp, name: module.get(comp, name).type if module.get(comp, name) else ""  # noqa: E731

    def cublas_flops(comp, ins):
        """A cuBLAS call's 2 · result elements · lhs dimensions summed (0: not a cuBLAS call)."""
        summed = re.search(r'custom_call_target="__cublas.*"lhs_contracting_dimensions":\[([\d",]*)\]', ins.attrs)
        if ins.op != "custom-call" or not summed:
            return 0
        lhs = dims(typ(comp, ins.operands[0]))
        K = np.prod([lhs[int(d)] for d in summed[1].replace('"', "").split(",") if d])
        return 2 * int(np.prod(dims(ins.type))) * int(K)

    def gemm_flops(comp):  # a fusion's: its dots (XLA's GEMM fusions) and cuBLAS calls (dynamic-slice fusions)
        flops = 0
        for ins in module.computations.get(comp, {}).values():
            if ins.op == "dot":
                lhs = dims(typ(comp, ins.operands[0]))
                contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)[1]
                flops += 2 * int(np.prod(dims(ins.type))) * int(np.prod([lhs[int(c)] for c in contracted.split(",") if c]))
            flops += cublas_flops(comp, ins)
        return flops

    def fusion_bytes(comp, ins, called):
        users = {}
        for user in module.computations[called].values():
            for j, operand in enumerate(user.operands):
                users.setdefault(operand, []).append((user, j))
        params = {int(p.operands[0]): p for p in module.computations[called].values() if p.op == "parameter"}
        root = module.get(called, module.roots[called])
        outputs = [r for r in ([module.get(called, o) for o in root.operands] if root.op == "tuple" else [root]) if r]
        in_place = {r.name for r in outputs if r.op == "dynamic-update-slice" or r.op == "scatter" and
                    module.get(called, r.operands[0]).op == "parameter"}  # XLA updates these outputs' buffers in place

        def sliced(name):
            """The elements of parameter `name` the kernel reads where every use slices it, directly or
            through bitcasts, reshapes, converts and transposes (or is a buffer an output updates in
            place); None where one reads it whole, or nothing uses it (counted whole, as XLA passes it)."""
            if not users.get(name):
                return None
            elements = 0
            for u, j in users[name]:
                if u.name in in_place and j == 0:
                    continue
                if u.op in ("dynamic-slice", "slice", "gather") and j == 0:
                    elements += int(np.prod(dims(u.type)))
                elif u.op in ("bitcast", "reshape", "convert", "transpose") and (inner := sliced(u.name)) is not None:
                    elements += inner
                else:
                    return None
            return elements

        moved = 0
        for i, operand in enumerate(ins.operands):
            whole, elements = type_bytes(typ(comp, operand)), sliced(params[i].name) if i in params else None
            if elements is None:
                moved += whole
            else:  # a slice of it, in its own element type
                moved += min(whole, elements * ELEMENT_BYTES.get(element_type(typ(comp, operand)), 4))
        for r in outputs:
            if r.name in in_place and r.op == "dynamic-update-slice":  # writes the update into its operand's buffer
                moved += type_bytes(typ(called, r.operands[1]))
            elif r.name in in_place:  # a scatter reads and writes the rows its updates (its last operands) add to
                moved += 2 * sum(type_bytes(typ(called, u)) for u in r.operands[(len(r.operands) + 1) // 2:])
            else:
                moved += type_bytes(r.type)
        return moved

    def source(ins, called):
        """ins's source line, or, for a fusion without one (XLA's dynamic-slice fusion of a cuBLAS call),
        its root's, else its library call's, else the first line an instruction inside it has."""
        line = where(ins.attrs)
        if line == "?" and called:
            inside = module.computations[called]
            calls = [i for i in inside.values() if i.op == "custom-call"]
            for inner in [inside[module.roots[called]], *calls, *inside.values()]:
                if (line := where(inner.attrs)) != "?":
                    break
        return line

    def walk(comp, times):
        for ins in module.computations[comp].values():
            if ins.op in FREE_OPS:
                continue
            called = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
            if ins.op == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
                if not trips:
                    unknown.append(ins.name)
                walk(re.search(r"body=%?([\w.\-]+)", ins.attrs)[1], times * (int(trips[1]) if trips else 1))
                continue
            if ins.op in ("conditional", "call"):
                targets = re.findall(r"(?:branch_computations=\{|_computation=|to_apply=|,\s*)%([\w.\-]+)", ins.attrs)
                for target in targets if branches or ins.op == "call" else []:
                    walk(target, times)
                continue
            if ins.op.endswith("-done") and ins.op.removesuffix("-done") in SENT_SHARE:  # counted at its start
                continue
            collective, sent = ins.op.removesuffix("-start"), 0
            if collective in SENT_SHARE:
                moved, flops = 0, 0
                operands = sum(type_bytes(typ(comp, o)) for o in ins.operands)
                result = type_bytes(ins.type) - (operands if ins.op.endswith("-start") else 0)  # a start's: (in, out)
                sent = SENT_SHARE[collective](group_size(ins, operands, result, devices)) * operands
            elif ins.op == "fusion" and called:
                moved, flops = fusion_bytes(comp, ins, called[1]), gemm_flops(called[1])
            elif ins.op == "dynamic-slice":
                moved, flops = 2 * type_bytes(ins.type), 0
            elif ins.op == "dynamic-update-slice":
                moved, flops = 2 * type_bytes(typ(comp, ins.operands[1])), 0
            else:
                moved, flops = type_bytes(ins.type) + sum(type_bytes(typ(comp, o)) for o in ins.operands), 0
                if pallas_gemm(ins):  # A (M x K) and B (N x K) first: 2·M·N·K
                    (M, K), (N, _) = dims(typ(comp, ins.operands[0])), dims(typ(comp, ins.operands[1]))
                    flops = 2 * M * N * K
                else:
                    flops = cublas_flops(comp, ins)
            row = rows.setdefault(source(ins, called[1] if called else None), [0, 0, 0, 0, 0])
            row[0] += moved * times
            row[1] += flops * times
            row[2] += times
            row[3] += sent * times
            row[4] += (instructions or {}).get(kernel_name(ins.name), 0) * times

    entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M)[1]
    walk(entry, 1)
    return rows, unknown


def kernel_name(instruction: str) -> str:
    """An HLO instruction's kernel as PTX, ptxas and the thunk sequence name it: '.' and '-' as '_'."""
    return re.sub(r"[.\-]", "_", instruction)


def kernel_sources(text: str) -> dict:
    """Kernel name (kernel_name) -> its source line."""
    module, where = parse_hlo(text), source_of(text)
    return {kernel_name(ins.name): where(ins.attrs) for comp in module.computations.values() for ins in comp.values()}


def traffic_lines(text: str, top: int, devices: int = 1, instructions: dict = None) -> list:
    """The estimate's line and its `top` costliest source lines; with collectives, also a step that runs
    no conditional's branch: a train step's even step, when Adam neither steps nor exchanges. With
    instructions (thread_instructions'), a line's floor is also its kernels' instructions at the H100's
    issue rate, where that is longer than its bytes' and FLOPs' ("issue-bound")."""
    rows, unknown = traffic(text, devices, instructions=instructions)
    issuing = lambda r: r[4] / ISSUES_PER_S  # noqa: E731
    moving = lambda r: max(r[0] / HBM_BYTES_PER_S, r[1] / GEMM_FLOPS_PER_S, r[3] / NVLINK_BYTES_PER_S)  # noqa: E731
    seconds = lambda r: max(moving(r), issuing(r))  # noqa: E731
    floors = lambda rows: sum(map(seconds, rows.values())) * 1e3  # noqa: E731
    moved, flops, sent = (sum(r[i] for r in rows.values()) for i in (0, 1, 3))
    lines = [f"    estimate: {moved / 1e9:.0f} GB moved ({moved / HBM_BYTES_PER_S * 1e3:.0f} ms at "
             f"{HBM_BYTES_PER_S / 1e12:.1f} TB/s), {flops / 1e12:.0f} TFLOP in GEMMs ({flops / GEMM_FLOPS_PER_S * 1e3:.0f} "
             f"ms at {GEMM_FLOPS_PER_S / 1e12:.0f} TFLOP/s), "
             + (f"{sent / 1e9:.2f} GB sent to the other devices ({sent / NVLINK_BYTES_PER_S * 1e3:.1f} ms at an assumed "
                f"{NVLINK_BYTES_PER_S / 1e9:.0f} GB/s of NVLink), " if sent else "")
             + f"sum of per-kernel floors {floors(rows):.0f} ms"
             + (f" ({sum(map(moving, rows.values())) * 1e3:.0f} without the instructions' floor)" if instructions else "")
             + (f"; {len(unknown)} loops counted once" if unknown else "")]
    if sent:
        even = traffic(text, devices, branches=False)[0]
        lines.append(f"    without conditionals' branches (an even step): {sum(r[0] for r in even.values()) / 1e9:.0f} GB "
                     f"moved, {sum(r[3] for r in even.values()) / 1e9:.2f} GB sent, sum of per-kernel floors "
                     f"{floors(even):.0f} ms")
    for source, r in sorted(rows.items(), key=lambda kv: -seconds(kv[1]))[:top]:
        lines.append(f"    {seconds(r) * 1e3:7.1f} ms {r[0] / 1e9:8.1f} GB {r[1] / 1e12:6.1f} TFLOP {r[2]:6d} kernels  "
                     + (f"{r[3] / 1e9:.2f} GB sent  " if r[3] else "")
                     + ("issue-bound  " if issuing(r) > moving(r) else "") + source)
    return lines


def program_rows(mesh, impl: str, which: str, hlo_dir: str = None, top: int = 0, mlp: str = "xla",
                 head: str = "xla", dc: str = "xla") -> list:
    hp = dataclasses.replace(tg.PRESETS["record"], attention=impl, dc=dc, mlp=mlp, head=head, compile_cache_dir="")
    named = kernels_named(hp)
    rows = []
    for name, lowered, chunk, is_train in record_programs(hp, mesh, which):
        t0, notes, before = time.perf_counter(), [], (dumped(), dumped("*thunk_sequence.txt"))
        with ptxas_notes(notes):
            compiled = lowered.compile()
        seconds = time.perf_counter() - t0
        instructions = thread_instructions(sorted(dumped() - before[0]),
                                           sorted(dumped("*thunk_sequence.txt") - before[1])) or None
        memory, text = compiled.memory_analysis(), compiled.as_text()
        # donated arguments come back as outputs in the same buffers (alias): count them once
        total = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                 + memory.temp_size_in_bytes)
        lines = [f"{impl:6s} {name:26s}{named} compile {seconds:5.1f}s  "
                 f"arguments {memory.argument_size_in_bytes / GIB:5.2f} "
                 f"GiB, temporaries {memory.temp_size_in_bytes / GIB:5.2f} GiB, in all {total / GIB:5.2f} of "
                 f"{H100_MEMORY / GIB:.1f} GiB"]
        # the train head's logits are the chunk's rows at once; validation's, LOSS_CHUNK rows at a time
        extra = head_logit_passes(text, hp.padded_vocab, chunk if is_train else math.gcd(chunk, tg.LOSS_CHUNK))
        if is_train:
            extra = beyond_the_head(extra, head)
            expected = "GEMM, sigmoids and gradient only" if head == "pallas" else "GEMM and gradient only"
        else:
            expected = "GEMM only"  # validation: no gradient
        logits_note = "head logits: " + ("EXTRA PASSES: " + "; ".join(extra) if extra else expected)
        stored = fp32_activations(text, chunk, (hp.model_dim, 3 * hp.model_dim, 4 * hp.model_dim))
        logits_note += "; activations: " + (f"{len(stored)} STORED IN FP32: {stored[0]}, ..." if stored else "bf16")
        if is_train:
            sites, problems = fp8_gemm_problems(text, hp.padded_vocab, dequant=float(tg.LM_HEAD_U_S))
            gemms = fp8_mlp_gemms(text, 4 * hp.model_dim)
            lines[0] += (f"  FP8: {len(sites)} head GEMMs " + ("ok" if not problems else f"PROBLEMS: {'; '.join(problems)}")
                         + f", {len(gemms)} MLP GEMMs" + ("" if len(gemms) >= 2 * tg.NUM_LAYERS else " (fewer than 22)")
                         + f"; {logits_note}")
            lines += traffic_lines(text, top, mesh.size, instructions) if top else []
        else:
            lines[0] += f"  {logits_note}"
        kernels = kernel_sources(text)
        lines += [f"    ptxas: {kernel} ({kernels.get(kernel, '?')}) {note}" for kernel, note in sorted(set(notes))]
        if hlo_dir:
            with open(os.path.join(hlo_dir, f"{impl}{named.replace(' ', '_')}_{name.replace(' ', '_')}.hlo.txt"),
                      "w") as f:
                f.write(text)
        rows.append("\n".join(lines))
        print(rows[-1], flush=True)
    return rows


def dumped(pattern: str = "*.ptx") -> set:
    """The files matching pattern that XLA has dumped so far (none where XLA_FLAGS named a dump folder)."""
    return set(glob.glob(os.path.join(PTX_DIR, pattern))) if PTX_DIR else set()


def thread_instructions(ptx_paths: list, sequence_paths: list) -> dict:
    """{kernel: PTX instructions x threads of one launch}, of the kernels whose PTX and launch (blocks x
    threads, in XLA's thunk sequence) were dumped: XLA's fused kernels (cuBLAS's have no PTX here, Pallas's
    go by their kernel's name); a loop's body counted once (instruction_count), so a reduction's is low."""
    threads = {}
    for path in sequence_paths:
        with open(path) as f:
            for m in re.finditer(r"\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]", f.read()):
                threads[m[1]] = math.prod(int(v) for v in m.groups()[1:])
    bodies = kernel_bodies(ptx_paths)
    return {kernel: instruction_count(bodies[kernel])[0] * n for kernel, n in threads.items() if kernel in bodies}


# the Pallas kernels a sweep item tunes, by the names their PTX entries have
SWEPT_KERNELS = {"fwd": ("attention_fwd",), "dq": ("attention_dq",), "dkv": ("attention_dkv",), "up": ("mlp_up",),
                 "dpre": ("mlp_dpre",), "dc": ("dc_fwd", "dc_dq", "dc_dkv")}


def kernel_bodies(paths: list) -> dict:
    """Each kernel's PTX text by its entry's name, up to the module's next entry or device function (dq and
    dk/dv share a module); a name in several files: the first file's."""
    bodies = {}
    for path in paths:
        with open(path) as f:
            text = f.read()
        starts = list(re.finditer(r"\.(entry|func)\s+(?:\([^)]*\)\s*)?(\w+)\(", text)) + [None]
        for start, after in zip(starts, starts[1:]):
            if start.group(1) == "entry":
                bodies.setdefault(start.group(2), text[start.start():after.start() if after else len(text)])
    return bodies


def mma_note(kernel: str, paths: list) -> str:
    """Which tensor-core instructions the kernel's PTX holds: Hopper's wgmma (warpgroup MMA, FP8 among
    its types) or Ampere's mma.sync (a third of the rate; FP8 operands on fp16 copies). '' when no PTX
    of the kernel was written (XLA_FLAGS set its own dump folder)."""
    body = kernel_bodies(paths).get(kernel)
    if body is None:
        return ""
    # wgmma.mma_async.sync.aligned.mMnNkK.ACCUMULATOR.A.B: the operand types
    types = sorted(set(re.findall(r"wgmma\.mma_async\.\S*?\.m\d+n\d+k\d+\.\w+\.(\w+)\.", body)))
    if types:
        return f", wgmma ({', '.join(types)})"
    return ", mma.sync: Ampere's tensor-core path, not Hopper's wgmma" if "mma.sync" in body else ", no MMA"


def ptx_instruction(line: str) -> list:
    """A PTX line's instruction as its words, its predicate (@%p1) dropped; [] for a directive, label,
    brace or comment. For XLA's fused kernels, which call nothing: a call's continued lines would count
    as instructions, and Triton's inline assembly in braces not at all."""
    words = line.split("//")[0].split()
    words = words[1:] if words and words[0].startswith("@") else words
    return words if words and not words[0].startswith((".", "{", "}", "(", ")", "$")) and not words[0].endswith(":") else []


def instruction_count(body: str) -> tuple:
    """(instructions, ex2 among them) in a kernel's PTX (kernel_bodies'), as ptx_instruction finds them after
    the .entry line; static, so a loop's body counts once, and every path of a branch, though a thread runs
    one (a fused concatenate of N arrays: N of them, as in the banks' gradient sums, which their bytes bound)."""
    ops = [words[0] for line in body.split("\n")[1:] if (words := ptx_instruction(line))]
    return len(ops), sum(op.startswith("ex2.") for op in ops)


REGISTERS_PER_SM = 65536  # an H100's multiprocessor's register file, 32-bit registers


def ptxas_binary():
    """ptxas from the CUDA plugin's wheel (nvidia/cu13/bin), else on PATH; None where there is none."""
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for found in glob.glob(os.path.join(root, "*", "bin", "ptxas")):
            return found
    return shutil.which("ptxas")


def registers_note(kernel: str, paths: list) -> str:
    """The kernel's registers a thread as ptxas -v gives them for sm_90a (its module recompiled alone), and
    how many of its programs a multiprocessor's registers hold (a warp's registers taken in 8s a thread):
    where that is 1, nothing overlaps one program's epilogue or softmax with another's MMAs. '' without
    ptxas or the kernel's PTX."""
    def text(path):
        with open(path) as f:
            return f.read()

    ptxas = ptxas_binary()
    path, module = next(((p, m) for p in paths if f".entry {kernel}(" in (m := text(p))), (None, ""))
    if not ptxas or not path:
        return ""
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    threads = re.search(r"\.(?:reqntid|maxntid) (\d+)", module.split(f".entry {kernel}(")[1])
    used = re.search(rf"Function properties for {kernel}\b[^\n]*\n(?:[^\n]*\n)*?[^\n]*Used (\d+) registers", out.stderr)
    if not used or not threads:
        return ""
    regs, n = int(used[1]), int(threads[1])
    fit = REGISTERS_PER_SM // (-(-regs // 8) * 8 * n)
    return f", {regs} registers a thread (registers for {fit} of its {n}-thread programs a multiprocessor)"


def block_map(body: str) -> str:
    """A kernel's PTX (kernel_bodies') as its basic blocks in order, each with its instructions (as
    instruction_count counts them) and, at each branch in it, those up to the branch and its target; a
    block without a final unconditional branch goes on into the next. From it a loop step's instructions
    on each path: e.g. the attention kernels' steps with and without their mask."""
    blocks, label, ops, marks = [], "entry", 0, []
    for line in body.split("\n")[1:] + ["$end:"]:
        if re.fullmatch(r"\$\w+:", line.strip()):
            blocks.append(f"{label} {ops}" + (f" ({', '.join(marks)})" if marks else ""))
            label, ops, marks = line.strip()[:-1], 0, []
        elif words := ptx_instruction(line):
            ops += 1
            if words[0].startswith("bra"):
                marks.append(f"{ops} to {words[-1].rstrip(';')}")
    return " | ".join(blocks)


def sweep_rows(mesh, configs: list, blocks: bool = False) -> list:
    """Compile each kernel configuration at the record's last-stage chunk (6 heads of 128): the
    forward kernel alone for fwd, the backward (dq and dk/dv, the other at its default) for dq, dkv;
    the MLP's kernels on the chunk's tokens at the record's width for up and dpre; the DC correction's
    forward and backward for dc (three kernels: a note each).
    Each row: whether it compiles, ptxas's spills, and (from its PTX) which MMA instructions it got; with
    blocks, a line a kernel: its PTX as block_map gives it."""
    hp = tg.PRESETS["record"]
    T = tg.stage_shape(tg.program_steps(hp)[-1], hp)[0]
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((T, tg.NUM_HEADS, hp.head_dim), tg.BF16, sharding=rep)
    lse = jax.ShapeDtypeStruct((tg.NUM_HEADS, T), tg.F32, sharding=rep)
    docs, window = (jax.ShapeDtypeStruct(s, jnp.int32, sharding=rep) for s in ((T,), ()))
    scale = jax.ShapeDtypeStruct((), tg.F32, sharding=rep)
    D, F = hp.model_dim, 4 * hp.model_dim
    f8, bf16, f32 = ((lambda *shape, t=t: jax.ShapeDtypeStruct(shape, t, sharding=rep))
                     for t in (tg.E4M3, tg.BF16, tg.F32))
    rows = []
    for kernel, tuning in configs:
        if kernel == "fwd":
            fn, args = (lambda q, k, v, d, w, s, t=tuning: tg._pallas_forward(q, k, v, d, w, s, t)), (x, x, x, docs)
        elif kernel in ("dq", "dkv"):
            knobs = {"dq_tuning": tuning} if kernel == "dq" else {"dkv_tuning": tuning}
            fn = lambda q, k, v, d, o, l, g, w, s, kw=knobs: tg._pallas_backward(q, k, v, d, w, s, o, l, g, **kw)  # noqa: E731
            args = (x, x, x, docs, x, lse, x)
        elif kernel == "up":
            fn = lambda x8, w8, dq, act, valid, t=tuning: tg.pallas_mlp_up(x8, w8, dq, act, valid, t)  # noqa: E731
            args = (f8(T, D), f8(F, D), f32(), f32(), jax.ShapeDtypeStruct((T,), jnp.bool_, sharding=rep))
        elif kernel == "dpre":
            fn = lambda g, w, post, t=tuning: tg.pallas_mlp_dpre(g, w, post, t)  # noqa: E731
            args = (bf16(T, D), bf16(F, D), bf16(T, F))
        else:  # dc: forward and backward
            fn = lambda *a, t=tuning: dc_forward_backward(*a, tuning=t)  # noqa: E731
            args = (x, x, x, x, docs, bf16(T, tg.NUM_HEADS), bf16(T, tg.NUM_HEADS), scale, x)
        args += (window, scale) if kernel in ("fwd", "dq", "dkv") else ()  # (dc's: no window)
        in_specs = (P(),) * len(args)  # the Pallas kernels lower for CUDA inside a mesh of CUDA devices
        program = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False))
        name = tuning_name(kernel, tuning)
        try:
            notes, before = [], dumped()
            with ptxas_notes(notes):
                program.lower(*args).compile()
            ptx = sorted(dumped() - before)
            kernels = SWEPT_KERNELS[kernel]
            named = lambda k: f"; {k}" if len(kernels) > 1 else ""  # noqa: E731  (which of several a note is of)
            rows.append(f"{name:14s} compiles" + ("".join(f"; {k} {n}" for k, n in notes) if notes else ", no spills")
                        + "".join(named(k) + mma_note(k, ptx) + registers_note(k, ptx) for k in kernels))
            for k in kernels if blocks else ():
                body = kernel_bodies(ptx).get(k)
                rows[-1] += f"\n    {k}'s PTX blocks: {block_map(body)}" if body else ""
        except Exception as e:  # noqa: BLE001  (a configuration Triton rejects is a row, not the end)
            rows.append(f"{name:14s} FAILS: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        print(rows[-1], flush=True)
    return rows


def head_ptx_rows(mesh, impl: str) -> list:
    """The training head's forward (train_gpt._train_head_fwd with impl: the FP8 GEMM and the passes over
    its logits) compiled alone at the record's last-stage chunk (its rows, its targets a row): a row per
    kernel with its PTX instructions and its exponentials (ex2). A logit takes two ex2 in XLA's passes and
    in head_softcap (the softcap's sigmoid, the softmax's exp), one in head_grad (it reads the sigmoids),
    so instructions per ex2 times that is a logit's; a reduction's loop body counts once, with the code
    before and after it (a bound from above)."""
    hp = tg.PRESETS["record"]
    T, mtp_terms = tg.stage_shape(tg.program_steps(hp)[-1], hp)
    D, V = tg.param_shapes(hp)["lm_head.weight"][0]  # the padded vocabulary
    P_ = mtp_terms + 1  # the MTP targets and the prefix target
    rep = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rep) for shape, dtype in
            (((T, D), tg.BF16), ((D, V), tg.BF16), ((T, P_), jnp.int32), ((T, P_), tg.F32), ((T,), tg.F32))]
    head = jax.shard_map(lambda *a: tg._train_head_fwd(*a, impl)[:2], mesh=mesh, in_specs=(P(),) * len(args),
                         out_specs=(P(), P()), check_vma=False)  # the Pallas kernels lower inside a mesh
    before = dumped()
    jax.jit(head, compiler_options=tg.COMPILER_OPTIONS).lower(*args).compile()
    rows = [f"--head-ptx: the training head's forward alone (--head {impl}), {T} rows x {V} logits, {P_} targets a row"]
    for kernel, body in sorted(kernel_bodies(sorted(dumped() - before)).items()):
        count, ex2 = instruction_count(body)
        rows.append(f"    {kernel:32s} {count:5d} PTX instructions" + (
            f", {ex2:3d} ex2: {count / ex2:5.1f} per ex2" if ex2 else ""))
    print("\n".join(rows), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", default="xla,pallas", help="comma-separated implementations (default both)")
    parser.add_argument("--dc", choices=sorted(tg.ADD_DC_CORRECTION),
                        help="train_gpt.py's --dc (default: each row's --attention, as before the DC correction had a "
                             "flag of its own; train_gpt.py's auto takes xla until a GPU has run the kernels: AUTO_ON_GPU)")
    parser.add_argument("--mlp", default="pallas", choices=tg.GEMM_IMPLEMENTATIONS,
                        help="train_gpt.py's --mlp (default pallas, the Pallas kernels)")
    parser.add_argument("--head", default="pallas", choices=tg.GEMM_IMPLEMENTATIONS,
                        help="train_gpt.py's --head (default pallas, the Pallas kernels, which train_gpt.py's auto "
                             "leaves for XLA's passes until a GPU has run their fix: AUTO_ON_GPU)")
    parser.add_argument("--programs", default="all", choices=("all", "last", "none"),
                        help="all: each stage shape's train program and validation; last: the last stage's train "
                             "program; none: only --sweep or --head-ptx")
    parser.add_argument("--sweep", metavar="CONFIGS", help="KERNEL:TILE/WARPS/STAGES items as bench.py --sweep takes")
    parser.add_argument("--ptx-blocks", action="store_true",
                        help="with --sweep: each swept kernel's PTX as basic blocks, their instructions and branches")
    parser.add_argument("--head-ptx", action="store_true",
                        help="the training head's forward alone (--head's) at the last stage's chunk: each kernel's PTX "
                             "instructions and exponentials (ex2)")
    parser.add_argument("--hlo-dir", metavar="DIR", help="write each train program's compiled HLO text there")
    parser.add_argument("--devices", type=int, default=1, choices=(1, 2, 4, 8),
                        help="compile for this many H100s of one machine, as train_gpt.py runs on them (default 1; 8: "
                             "the record's machine, one chunk per device; memory and the estimate are one device's)")
    parser.add_argument("--traffic", type=int, default=15, metavar="N",
                        help="per train program: a static estimate of a step's memory traffic, GEMM FLOPs and kernels' "
                             "instructions, and its N costliest source lines (default 15; 0: none)")
    args = parser.parse_args(argv)
    impls = args.attention.split(",")
    try:
        unknown = [i for i in impls if i not in tg.ATTENTION]
        if unknown:
            raise ValueError(f"--attention {args.attention}: {unknown} not among {sorted(tg.ATTENTION)}")
        configs = parse_sweep(args.sweep) if args.sweep else []
    except ValueError as e:
        parser.error(str(e))
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    mesh = h100_mesh(args.devices)
    print(f"compile-only NVIDIA H100 (sm_90) x {args.devices}, jax {jax.__version__}, record preset; compile times on "
          f"{os.cpu_count()} CPU cores, without autotuning", flush=True)
    rows = [] if args.programs == "none" else [r for impl in impls for r in program_rows(
        mesh, impl, args.programs, args.hlo_dir, args.traffic, args.mlp, args.head, args.dc or impl)]
    rows += sweep_rows(mesh, configs, args.ptx_blocks)
    rows += head_ptx_rows(mesh, args.head) if args.head_ptx else []
    return 1 if any("PROBLEMS" in r or "fewer than" in r or "FAILS" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
