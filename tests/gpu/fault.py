"""Which kernel a GPU fault stopped, and what XLA had made of it.

    python3 tests/gpu/fault.py DIR

DIR holds what tests/gpu/session.sh's crash-IMPL piece gave the crashing run: the CUDA core dump the
driver wrote at the fault (CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1, CUDA_COREDUMP_FILE=DIR/core.%p) and
XLA's dumps of the compiled programs (XLA_FLAGS=--xla_dump_to=DIR/xla --xla_dump_hlo_as_text). This
prints cuda-gdb's reading of the dump (the exception and the faulting kernel), then, for each kernel
named there, the instruction of the optimized HLO that XLA compiled into it (XLA names a fusion's
kernel after the fusion, '.' and '-' made '_'), with its metadata (the JAX op), the fused computation
and the program's parameters (their shapes say which stage's program it is). A library kernel (cuBLAS)
or a Pallas kernel (named after its Python function) has no instruction of its name: cuda-gdb's
output names it. Without a core dump in DIR (no fault) it
says so.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

KERNEL = re.compile(r"([A-Za-z_][\w$]*)<<<")  # `#0 0x... in loop_fusion_12<<<(16384,1,1),(128,1,1)>>> ()`


def kernel_names(gdb_text: str) -> list:
    """The kernels cuda-gdb's output names, first seen first."""
    return list(dict.fromkeys(KERNEL.findall(gdb_text)))


def instructions_of(kernel: str, hlo_text: str) -> list:
    """The lines of instructions XLA would name `kernel`: each '_' of the name may be '.', '-' or '_'."""
    name = "[._-]".join(map(re.escape, kernel.split("_")))
    return re.findall(rf"^\s*(?:ROOT\s+)?%?{name} = .*$", hlo_text, re.M)


def computation(name: str, hlo_text: str, max_lines: int = 40) -> str:
    """The text of computation `name` (`%name (...) -> ... {` to its closing brace), at most max_lines lines."""
    block = re.search(rf"^%?{re.escape(name)} [^\n]*\{{\n.*?^\}}", hlo_text, re.M | re.S)
    if not block:
        return ""
    lines = block[0].splitlines()
    return "\n".join(lines[:max_lines] + ([f"  ... ({len(lines) - max_lines} more lines)"] * (len(lines) > max_lines)))


def report(kernel: str, dumps: dict, width: int = 600) -> list:
    """For each dumped program holding an instruction named like `kernel`: its file, its parameters, the
    instruction and the computation it calls."""
    out = []
    for path, text in dumps.items():
        for line in instructions_of(kernel, text):
            entry = re.search(r"^ENTRY .*$", text, re.M)
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            out += [f"-- {kernel} in {os.path.basename(path)}",
                    f"   program: {entry[0][:width] if entry else '?'}", f"   {line.strip()[:width]}"]
            if calls:
                out.append(computation(calls[1], text))
    return out or [f"-- {kernel}: no instruction of that name in the dumped programs (a library kernel, "
                   f"or a Pallas kernel: those are named after their Python function)"]


def main(argv) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    folder = argv[0]
    cores = sorted(glob.glob(os.path.join(folder, "core*")), key=os.path.getmtime)
    if not cores:
        print(f"no CUDA core dump in {folder}: no device fault, or the driver wrote none")
        return 0
    gdb = shutil.which("cuda-gdb") or "/usr/local/cuda/bin/cuda-gdb"
    try:  # (the session gives this piece 120 s)
        p = subprocess.run([gdb, "-batch", "-ex", f"target cudacore {cores[0]}", "-ex", "info cuda kernels",
                            "-ex", "bt 8"], capture_output=True, text=True, timeout=90)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"cuda-gdb could not read {cores[0]}: {type(e).__name__}: {e}")
        return 1
    gdb_text = p.stdout + p.stderr
    print(f"cuda-gdb on {cores[0]} ({len(cores)} core dump(s)), exit {p.returncode}:")
    print("\n".join(gdb_text.splitlines()[-60:]), flush=True)
    dumps = {}
    for path in glob.glob(os.path.join(folder, "xla", "*after_optimizations.txt")):
        with open(path) as f:
            dumps[path] = f.read()
    print(f"\n{len(dumps)} optimized programs dumped in {folder}/xla")
    for kernel in kernel_names(gdb_text):
        print("\n".join(report(kernel, dumps)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
