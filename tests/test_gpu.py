"""GPU test lane: what only a GPU can show. Skipped unless `jax.default_backend() == "gpu"`.

    python3 -m pytest -q -n 4 tests/test_gpu.py   # cases side by side: no GPU memory preallocated

Three kinds of case, each run by `python tests/test_gpu.py CASE ...` in its own process, so a CUDA
fault in one (CUDA_ERROR_ILLEGAL_INSTRUCTION, a segfault) fails that test with the child's output
tail and leaves the others running:

  train PRESET T DIR       train() on PRESET with chunks of T tokens (8 per step, on all local
                           devices) in every stage, 6 + 1 steps, validating at steps 0, 3, 6 and at
                           the end (final windows) on the shards in DIR/shards; by hand, write them
                           first: python data/synthetic.py --out DIR/shards --train-tokens
                           112(T+1000) --val-tokens 8T+2 (with T's value)
  hlo PRESET T FILE IMPL   the compiled train program of the last stage (chunks of T) with --mlp IMPL and
                           --head IMPL (xla, pallas), HLO text to FILE
  attention IMPL W T H     tg.ATTENTION[IMPL] forward and gradients at T tokens, H heads of the
                           record's 128, window W tokens, against a dense fp32 reference on 4 query
                           blocks (H = 3 with 2T: the paired layers' doubled sequence)
  mlp T                    the FP8 MLP's Pallas kernels (--mlp pallas) at T tokens of the record's
                           width against float64 on sampled rows, and the whole MLP against --mlp xla
  head T                   the FP8 head with --head pallas against --head xla at T tokens: losses, gradients
  dc T                     layer 10's DC correction with --dc pallas against the XLA path at T
                           tokens: the output and every gradient

e.g. `python tests/test_gpu.py attention xla 2560 49152 6`; the last line printed is `RESULT {json}`.
Bisecting a crash: the children inherit the environment, so XLA_FLAGS (`--xla_dump_to=DIR`,
`--xla_gpu_enable_triton_gemm=true`, `--xla_gpu_autotune_level=0`, ...), CUDA_LAUNCH_BLOCKING=1
or JAX_* settings given to pytest apply to every case, on top of train_gpt.backend_defaults (XLA's
Triton GEMMs off unless XLA_FLAGS names that flag), which a training run starts with too.
GPU_LANE_TIMEOUT (seconds, default 900) bounds each child. GPU_LANE_RESULTS=FILE appends each case's
RESULT to FILE as the case ends, passed or not (pytest prints a passed case's output nowhere).

GPU_LANE_ON_CPU=1 dry-runs the lane's logic on CPU at small shapes (cpu preset with T = 256 for
training; T = 4,096 for attention). XLA:CPU has no FP8 GEMM, so there the HLO case asserts the
opposite: the checker rejects every head matmul and finds no FP8 MLP GEMM. Not part of CI.

The HLO checker (fp8_gemm_problems, fp8_mlp_gemms, head_logit_passes and their parser) is pure text
processing; its unit tests below run everywhere, on hand-written HLO in the formats XLA prints.
"""
import dataclasses
import json
import math
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tarfile
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # a case runs as `python tests/test_gpu.py`, outside pytest
# The cases get the environment as given (XLA_FLAGS, ...), unbuffered output that survives a crash, and
# (unless told otherwise) no preallocation of the GPU's memory, so that cases can run side by side (pytest -n).
CHILD_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ, "PYTHONUNBUFFERED": "1"}
if __name__ != "__main__":  # pytest only asks for the backend's name: it leaves the GPU memory to the cases
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
else:  # a case starts its backend as a training run does (XLA's flags, the pool), before the line below
    import train_gpt

    train_gpt.backend_defaults()
BACKEND = jax.default_backend()  # decided once, at import: the skip costs nothing more
ON_GPU = BACKEND == "gpu"
LANE = ON_GPU or os.environ.get("GPU_LANE_ON_CPU") == "1"
# record: chunks of 8,192 tokens (65,536 per step); attention at the last stage's chunk, 49,152 tokens
PRESET, TRAIN_T, ATTENTION_T = ("record", 8192, 49152) if ON_GPU else ("cpu", 256, 4096)
TIMEOUT = int(os.environ.get("GPU_LANE_TIMEOUT", "900"))
PADDED_VOCAB = 50304  # the head's rows: a matmul with this dimension is a head matmul
MLP_HIDDEN = {"record": 3072, "cpu": 384}[PRESET]  # 4 x model dim: a matmul with it is an MLP matmul

lane = pytest.mark.skipif(not LANE, reason=f"GPU lane: JAX backend is {BACKEND}, not gpu")

# Tolerances of the attention case, as max|impl - ref| / max|ref|. The implementation takes bf16
# q, k, v and returns bf16: rounding the output alone costs up to 2^-8 = 0.4% of an element; the
# probabilities are rounded to bf16 before p·v (0.4% per term, averaging out over the keys), with
# fp32 softmax and accumulation. Gradients also round dS = P·(dP − Δ) to bf16 after a cancellation
# (dP − Δ), so their error is larger. Measured on CPU (record 20's kernel, T = 4,096): 0.2-0.3%
# outputs, 0.3-0.6% gradients, so 2e-2 / 5e-2 leave margins of 5x or more. A leaked document or a
# window a block off gives errors of order 1 to several %; a window one token off is the CPU tests'
# to catch (exact dense comparisons at small windows in tests/test_model.py and test_attention.py).
OUT_TOL, GRAD_TOL = 2e-2, 5e-2


# ---------------------------------------------------------------------------------------------
# Running a case in a child process


def run_case(*args):
    """Run `python tests/test_gpu.py ARGS` and return the JSON of its `RESULT` line.

    Fails with the child's exit status (or signal) and the tail of its output when it does not
    finish cleanly."""
    cmd = [sys.executable, "-X", "faulthandler", os.path.abspath(__file__), *map(str, args)]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as e:
        out, err = ((b or b"").decode(errors="replace") for b in (e.stdout, e.stderr))  # bytes, even with text=True
        pytest.fail(f"case {args} ran past GPU_LANE_TIMEOUT={TIMEOUT}s\n{tails(out, err)}")
    if p.returncode != 0:
        how = f"signal {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit code {p.returncode}"
        pytest.fail(f"case {args} failed with {how}\n{tails(p.stdout, p.stderr)}")
    results = [line[len("RESULT "):] for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"case {args} printed no RESULT line\n{tails(p.stdout, p.stderr)}"
    if os.environ.get("GPU_LANE_RESULTS"):  # a case's numbers, passed or failed, as it ends (one line each)
        with open(os.environ["GPU_LANE_RESULTS"], "a") as f:
            f.write(json.dumps({"case": [str(a) for a in args], "result": json.loads(results[-1])}) + "\n")
    return json.loads(results[-1])


def tails(out: str, err: str, n: int = 6000) -> str:
    return f"--- stdout (last {n} chars) ---\n{out[-n:]}\n--- stderr (last {n} chars) ---\n{err[-n:]}"


# ---------------------------------------------------------------------------------------------
# (a) Training: the record model, chunks of 8,192 tokens, 6 + 1 steps through every stage shape


@lane
def test_train_through_every_stage_validates_with_a_complete_log(tmp_path):
    from data.synthetic import write_synthetic_shards
    from records.logs import parse_log

    T = TRAIN_T
    train_tokens = 2 * 7 * 8 * (T + 1000)  # 7 steps of 8 chunks, each of whole documents (mean 400 tokens) cut at T
    write_synthetic_shards(str(tmp_path / "shards"), seed=1, train_tokens=train_tokens, val_tokens=8 * T + 2,
                           shard_tokens=train_tokens)
    result = run_case("train", PRESET, T, tmp_path)

    run = parse_log(result["log"])
    assert run.status == "complete", run.last_line
    assert run.preset == PRESET and run.num_iterations == 7
    assert [s for s, *_ in run.val_curve] == [0, 3, 6, 7]
    assert [s for s, *_ in run.train_steps] == list(range(1, 8))
    losses = [loss for _, loss, _ in run.val_curve]
    assert all(math.isfinite(x) for x in losses), losses
    # step 0 is the untrained model: a head of std 0.005 gives near-uniform predictions, ln(50304)
    assert abs(losses[0] - math.log(PADDED_VOCAB)) < 0.05, losses
    assert losses[-1] < losses[0], losses
    assert run.final_val_loss == pytest.approx(losses[-1], abs=1e-4)
    assert result["final_val_loss"] == pytest.approx(run.final_val_loss, abs=1e-4)
    assert run.train_time_ms > 0 and run.compile_s is not None
    with open(os.path.join(ROOT, "train_gpt.py")) as f:
        assert run.source == f.read()


def lane_hp(preset: str, T: int, **changes):
    """PRESET with chunks of T tokens (documents cut at T at most) in every stage, 6 + 1 steps."""
    import train_gpt as tg

    base = tg.PRESETS[preset]
    stages = tuple(dataclasses.replace(s, batch_size=8 * T, max_seq_len=min(T, s.max_seq_len)) for s in base.stages)
    return dataclasses.replace(base, stages=stages, num_scheduled_iterations=6, num_extension_iterations=1,
                               fp8_bootstrap_steps=2, muon_momentum_warmup_steps=2, muon_momentum_cooldown_steps=1,
                               val_batch_size=8 * T, val_tokens=8 * T, val_loss_every=3, compile_cache_dir="",
                               **changes)


def case_train(preset: str, T: int, out_dir: str) -> dict:
    import train_gpt as tg

    hp = lane_hp(preset, T, train_files=os.path.join(out_dir, "shards", "synthetic_train_*.bin"),
                 val_files=os.path.join(out_dir, "shards", "synthetic_val_*.bin"),
                 records_dir=os.path.join(out_dir, "records"),
                 **{name: tg.auto_implementation(name) for name in tg.AUTO_FIELDS})  # what a user's run takes
    windows = [tg.windows(step, hp, final_val=step == hp.total_steps) for step in (0, 3, 6, 7)]
    print(f"(short, long) windows at the validations: {windows}", flush=True)
    summary = tg.train(hp, preset, tg.make_mesh())
    return {"windows": windows, **summary}


# ---------------------------------------------------------------------------------------------
# (b) FP8 head: in the compiled train step every head matmul is an FP8 GEMM


@lane
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_train_program_gemms_are_fp8_and_its_activations_bf16(tmp_path, impl):
    if impl == "pallas" and not ON_GPU:
        pytest.skip("the dry run checks the XLA path's matmuls (interpreted, Pallas kernels are no GEMM calls)")
    hlo_file = tmp_path / "train_step.hlo.txt"
    run_case("hlo", PRESET, TRAIN_T, hlo_file, impl)
    import train_gpt as tg

    text = hlo_file.read_text()
    sites, problems = fp8_gemm_problems(text, PADDED_VOCAB, dequant=float(tg.LM_HEAD_U_S))
    mlp = fp8_mlp_gemms(text, MLP_HIDDEN)
    listing = "\n".join(f"  {s}" for s in sites)
    if not ON_GPU:  # dry run: XLA:CPU has no FP8 GEMM, and the checker must reject every head matmul
        assert len(sites) >= 3 and all(any(f"{s}: a head matmul with f32 x f32" in p for p in problems)
                                       for s in sites), listing
        assert mlp == [], mlp
        return
    assert not problems, ("\n".join(problems) + f"\nhead matmuls found:\n{listing}\n(HLO text: {hlo_file})")
    # the up projection (x · W1) and the down projection (post · W2) of each of the 11 layers
    assert len(mlp) >= 2 * 11, ("\n".join(f"  {g}" for g in mlp) + f"\n(HLO text: {hlo_file})")
    # the head's logits: the GEMM's bf16 ones, the gradient (and the Pallas head's sigmoids), nothing else of their size
    extra = beyond_the_head(head_logit_passes(text, PADDED_VOCAB, TRAIN_T), impl)
    assert not extra, "\n".join(extra) + f"\n(HLO text: {hlo_file})"
    # activations in bf16, as the code rounds them (not on the dry run: XLA:CPU's dots read fp32 copies)
    widths = (MLP_HIDDEN // 4, 3 * MLP_HIDDEN // 4, MLP_HIDDEN)  # the model's, the fused qkv's, the MLP's
    stored = fp32_activations(text, TRAIN_T, widths)
    assert not stored, "\n".join(stored) + f"\n(HLO text: {hlo_file})"
    print(f"{len(sites)} head matmuls, all FP8 GEMMs:\n{listing}\n{len(mlp)} FP8 MLP GEMMs")


def case_hlo(preset: str, T: int, out_file: str, impl: str) -> dict:
    import train_gpt as tg

    hp = lane_hp(preset, T, mlp=impl, head=impl)
    mesh = tg.make_mesh(jax.devices()[:1])
    state = tg.initial_state(hp, mesh)
    prefix_V = jnp.asarray(tg.prefix_table(hp.padded_vocab))
    first = tg.stage_bounds(hp)[2][0]  # the last scheduled stage: one MTP weight
    by_chunk = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
    batch = jax.ShapeDtypeStruct((tg.RANKS, T), jnp.int32, sharding=by_chunk)
    text = tg.make_train_step(hp, mesh).lower(*state, batch, batch, *tg.step_inputs(first, hp),
                                              prefix_V).compile().as_text()
    with open(out_file, "w") as f:
        f.write(text)
    return {"hlo_chars": len(text)}


# The checker. Compiled HLO text is a list of computations, each a list of instructions:
#   [ROOT] %name = TYPE opcode(OPERANDS), attr=..., calls=%comp, custom_call_target="...", backend_config={...}
# where TYPE is `f8e4m3fn[8192,768]{1,0}` or a tuple `(bf16[..]{..}, s8[..]{..})`, and an operand is
# `%name`, or `TYPE %name` in some printers.

F8_TYPES = ("f8e4m3fn", "f8e5m2")
CUBLAS_FP8 = "__cublas$lt$matmul$f8"
GEMM_FUSION_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cudnn$fusion")
# train_gpt.py's Pallas kernels that are GEMMs (Triton custom calls, by their pallas_call name): their first
# two operands are the GEMM's (train_gpt._GemmGrid)
PALLAS_GEMMS = ("mlp_up", "mlp_dpre")
TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas kernel's custom call (its name in the backend config)
PASS_THROUGH = ("bitcast", "copy", "transpose", "reshape", "slice", "dynamic-slice", "broadcast")


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    op: str
    operands: list  # operand names, without %
    attrs: str
    computation: str


@dataclasses.dataclass
class Module:
    computations: dict  # name -> {instruction name -> Instr}, in text order
    roots: dict  # computation name -> root instruction name
    callers: dict  # computation name -> [fusion Instr calling it]

    def get(self, computation: str, name: str):
        return self.computations.get(computation, {}).get(name)


@dataclasses.dataclass
class Gemm:
    name: str
    computation: str
    kernel: str  # a custom-call target, a GEMM fusion kind, or "dot" (not lowered to a GEMM kernel)
    lhs: str  # operand types
    rhs: str
    result: str

    def __str__(self):
        return f"{self.name} in {self.computation}: {self.kernel}({self.lhs}, {self.rhs}) -> {self.result}"


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket that closes text[start] ('(' or '{'), counting both kinds."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "({":
            depth += 1
        elif text[i] in ")}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO line: {text!r}")


def _split_top_level(text: str) -> list:
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "({["
        depth -= ch in ")}]"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p.strip() for p in parts + [current] if p.strip()]


COMPUTATION_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
OPCODE = re.compile(r"\s*([\w\-]+)\(")
COMMENT = re.compile(r"/\*.*?\*/")


def parse_hlo(text: str) -> Module:
    """The computations and instructions of an HLO module's text (one instruction per line)."""
    computations, roots, callers, current = {}, {}, {}, None
    for line in text.splitlines():
        if current is None:
            m = COMPUTATION_HEADER.match(line)
            if m:
                current = m[1]
                computations[current] = {}
            continue
        if line.strip() == "}":
            current = None
            continue
        m = INSTRUCTION.match(line)
        if not m:
            continue
        is_root, name, rest = m[1], m[2], m[3]
        end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
        if end < 0:
            continue
        type_, rest = COMMENT.sub("", rest[:end]), rest[end:]  # a tuple's 6th, 11th, ... element: /*index=5*/
        op = OPCODE.match(rest)
        if not op:
            continue
        close = _balanced(rest, op.end() - 1)
        # an operand may be typed (`f32[4]{0} %x`) or follow the comment XLA writes every fifth (`/*index=5*/%x`)
        operands = [COMMENT.sub(" ", o).split()[-1].lstrip("%") for o in _split_top_level(rest[op.end():close - 1])]
        ins = Instr(name, type_, op[1], operands, rest[close:], current)
        computations[current][name] = ins
        if is_root:
            roots[current] = name
        called = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)
        if called:
            callers.setdefault(called[1], []).append(ins)
    return Module(computations, roots, callers)


def element_type(type_: str) -> str:
    """`f8e4m3fn[8,4]{1,0}` -> f8e4m3fn; a tuple gives its first element's type."""
    m = re.match(r"\(?\s*(\w+)\[", type_)
    return m[1] if m else type_


def dims(type_: str) -> list:
    m = re.match(r"\(?\s*\w+\[([\d,]*)\]", type_)
    return [int(d) for d in m[1].split(",") if d] if m else []


def _operand_type(module: Module, ins: Instr, i: int) -> str:
    producer = module.get(ins.computation, ins.operands[i])
    return producer.type if producer else "?"


def _fusion_kind(ins: Instr) -> str:
    m = re.search(r'"kind"\s*:\s*"([^"]+)"', ins.attrs)
    return m[1] if m else ""


def _custom_fusion(ins: Instr) -> str:
    """A custom fusion's name (XLA's dynamic_slice_fusion: a library call reading or writing slices in place)."""
    m = re.search(r'"custom_fusion_config"\s*:\s*\{"name"\s*:\s*"([^"]+)"', ins.attrs)
    return m[1] if m else ""


def _call_target(ins: Instr) -> str:
    """A custom call's target ("__cublas$lt$matmul", a Triton call, ...), else ""."""
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    return target[1] if target else ""


def _cublas_call(ins: Instr) -> bool:
    return _call_target(ins).startswith("__cublas")


def pallas_kernel(ins: Instr):
    """The kernel's name of a Pallas kernel's custom call (a Triton call), else None."""
    name = re.search(r'\bname = "([^"]+)"', ins.attrs)
    return name[1] if ins.op == "custom-call" and _call_target(ins) == TRITON_CALL and name else None


def pallas_gemm(ins: Instr):
    """"pallas NAME" for a custom call of one of train_gpt.py's Pallas GEMM kernels, else None."""
    name = pallas_kernel(ins)
    return f"pallas {name}" if name in PALLAS_GEMMS else None


def gemm_sites(module: Module) -> list:
    """Every matrix multiplication: GEMM custom calls (cuBLAS, train_gpt's Pallas GEMM kernels) and dot
    instructions. A dot inside a Triton or cuDNN GEMM fusion gets that fusion's kind as its kernel; any
    other dot is "dot"."""
    sites = []
    for comp, instrs in module.computations.items():
        for ins in instrs.values():
            if ins.op == "custom-call":
                kernel = pallas_gemm(ins) or (_call_target(ins) if _cublas_call(ins) else None)
                if not (kernel and len(ins.operands) >= 2):
                    continue
            elif ins.op == "dot":
                kinds = [_fusion_kind(c) for c in module.callers.get(comp, [])]
                kernel = next((k for k in kinds if k in GEMM_FUSION_KINDS), "dot")
            else:
                continue
            sites.append(Gemm(ins.name, comp, kernel, _operand_type(module, ins, 0), _operand_type(module, ins, 1),
                              ins.type))
    return sites


def upcast_from_f8(module: Module, computation: str, name: str, depth: int = 0) -> bool:
    """Whether this value is an f8 tensor converted to a wider type, looking through layout ops,
    into the root of a fusion that produces it, and out of a fused computation's parameters."""
    ins = module.get(computation, name)
    if ins is None or depth > 64:
        return False
    if ins.op == "convert":
        return element_type(_operand_type(module, ins, 0)) in F8_TYPES and element_type(ins.type) not in F8_TYPES
    if ins.op in PASS_THROUGH:
        return upcast_from_f8(module, computation, ins.operands[0], depth + 1)
    if ins.op == "fusion":
        called = re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)[1]
        return called in module.roots and upcast_from_f8(module, called, module.roots[called], depth + 1)
    if ins.op == "parameter":
        index = int(ins.operands[0])
        return any(upcast_from_f8(module, c.computation, c.operands[index], depth + 1)
                   for c in module.callers.get(computation, []) if index < len(c.operands))
    return False


def _scalar_constant(module: Module, ins: Instr, i: int):
    """The value of a custom call's i-th operand where it is a scalar constant, else None."""
    producer = module.get(ins.computation, ins.operands[i]) if i < len(ins.operands) else None
    try:
        return float(producer.operands[0]) if producer and producer.op == "constant" and dims(producer.type) == [] \
            else None
    except ValueError:
        return None


def _dequantization(module: Module, ins: Instr) -> list:
    """A cuBLASLt FP8 GEMM's output factors: [alpha, a's scale, b's scale] (None where not a constant)."""
    alpha = re.search(r'"alpha_real"\s*:\s*([-+.\deE]+)', ins.attrs)
    return [float(alpha[1]) if alpha else None, _scalar_constant(module, ins, 2), _scalar_constant(module, ins, 3)]


def fp8_gemm_problems(hlo_text: str, vocab: int, min_count: int = 3, dequant: float = None):
    """(head GEMMs, problems) for compiled HLO text; no problems means the FP8 head is real.

    A head GEMM is a matmul with a dimension of size `vocab` (operands or result). Each must take
    f8e4m3fn/f8e5m2 operands and run as an FP8 GEMM kernel (cuBLASLt's fp8 matmul, or a Triton or
    cuDNN GEMM fusion whose dot reads f8, or one of train_gpt's Pallas GEMM kernels). At least `min_count` must
    exist (forward, dx, dw; more
    when the forward is recomputed), forward (e4m3 x e4m3) and backward (an e5m2 gradient) among
    them; cuBLASLt's forward writes bf16 logits, and with `dequant` multiplies them by it (alpha times
    the operands' scales, within 1e-6). No matmul at all may read an f8 tensor upcast to bf16/f32 (an
    emulated FP8 matmul)."""
    module = parse_hlo(hlo_text)
    problems, heads = [], []
    for g in gemm_sites(module):
        ins = module.get(g.computation, g.name)
        for i in (0, 1):
            if upcast_from_f8(module, g.computation, ins.operands[i]):
                problems.append(f"{g}: operand {i} ({ins.operands[i]}) is an f8 tensor upcast to a wider type")
        if vocab not in dims(g.lhs) + dims(g.rhs) + dims(g.result):
            continue
        heads.append(g)
        types = (element_type(g.lhs), element_type(g.rhs))
        if not all(t in F8_TYPES for t in types):
            problems.append(f"{g}: a head matmul with {types[0]} x {types[1]} operands, not FP8")
        elif g.kernel == "dot":
            problems.append(f"{g}: a head matmul left as a plain dot, not lowered to a GEMM kernel")
        elif g.kernel.startswith("__cublas") and g.kernel != CUBLAS_FP8:
            problems.append(f"{g}: a head matmul run by {g.kernel}, not {CUBLAS_FP8}")
        elif g.kernel == CUBLAS_FP8 and types == ("f8e4m3fn", "f8e4m3fn"):
            if element_type(g.result) != "bf16":
                problems.append(f"{g}: cuBLASLt writes the logits in {element_type(g.result)}, not bf16 (train_gpt."
                                f"_fp8_logits' pattern not taken: a pass more rounds them)")
            factors = _dequantization(module, ins)
            if dequant is not None and (None in factors or abs(math.prod(factors) / dequant - 1) > 1e-6):
                problems.append(f"{g}: the logits multiplied by alpha, scales {factors}, not {dequant!r} in all")
    if len(heads) < min_count:
        problems.append(f"{len(heads)} head matmuls (a dimension of {vocab}) found, expected at least {min_count}: "
                        f"forward, dx and dw")
    kinds = [(element_type(g.lhs), element_type(g.rhs)) for g in heads]
    if ("f8e4m3fn", "f8e4m3fn") not in kinds:
        problems.append("no head matmul with f8e4m3fn x f8e4m3fn operands: the forward is not FP8")
    if not any("f8e5m2" in k for k in kinds):
        problems.append("no head matmul reads an f8e5m2 gradient: the backward is not FP8")
    return heads, problems


def fp8_mlp_gemms(hlo_text: str, hidden: int) -> list:
    """The MLP's FP8 GEMMs: matmuls with a dimension of size `hidden` (4 x model dim) that take
    f8e4m3fn x f8e4m3fn operands and run as a GEMM kernel (the up and down projections' forward;
    their backward is bf16). Emulated FP8 (an f8 tensor upcast before a matmul) is fp8_gemm_problems'."""
    return [g for g in gemm_sites(parse_hlo(hlo_text))
            if hidden in dims(g.lhs) + dims(g.rhs) + dims(g.result) and g.kernel != "dot"
            and (element_type(g.lhs), element_type(g.rhs)) == ("f8e4m3fn", "f8e4m3fn")]


def _array_types(type_: str) -> list:
    """The array types of a result: itself, or a tuple's elements, nested tuples flattened."""
    if not type_.startswith("("):
        return [type_]
    return [t for part in _split_top_level(type_[1:_balanced(type_, 0) - 1]) for t in _array_types(part)]


def _kernels(module: Module):
    """(computation, instruction) of each instruction that writes memory: outside fused computations (whose
    instructions write nothing), not a parameter, tuple, bitcast, constant, loop or call, nor an async op's
    start (its -done writes)."""
    for comp, instrs in module.computations.items():
        if comp in module.callers:
            continue
        for ins in instrs.values():
            if ins.op not in ("parameter", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "while",
                              "conditional", "call", "constant") and not ins.op.endswith("-start"):
                yield comp, ins


def _is_gemm(module: Module, ins: Instr) -> bool:
    """A GEMM kernel: a cuBLAS call, one in a dynamic-slice fusion (reading a slice in place), a GEMM fusion,
    or a Pallas GEMM."""
    return (_fusion_kind(ins) in GEMM_FUSION_KINDS or _cublas_call(ins) or pallas_gemm(ins) is not None
            or _custom_fusion(ins) == "dynamic_slice_fusion" and any(
                map(_cublas_call, module.computations[re.search(r"\bcalls=%?([\w.\-]+)", ins.attrs)[1]].values())))


def head_logit_passes(hlo_text: str, vocab: int, rows: int) -> list:
    """Kernels that write an array of the head's logits beyond the two the fused head needs, as text:
    a kernel (an instruction outside fused computations; each output of a multi-output one) writing
    a (rows, vocab) array, either way round (rows: a train chunk's, or a validation loss chunk's), that
    is neither a GEMM's bf16 logits nor the e5m2 gradient, e.g. the softcap's sigmoid
    or fp32 z kept between the normaliser and gradient passes: a pass over every logit more. A Pallas
    kernel's is named with the kernel ("custom-call head_softcap writes ...")."""
    module = parse_hlo(hlo_text)
    extra = []
    for comp, ins in _kernels(module):
        gemm = _is_gemm(module, ins)
        kernel = pallas_kernel(ins)
        for t in _array_types(ins.type):
            if sorted(dims(t)[-2:]) != sorted([rows, vocab]) or element_type(t) == "f8e5m2" \
                    or (gemm and element_type(t) == "bf16"):
                continue
            extra.append(f"{ins.name} in {comp}: {ins.op}{' ' + kernel if kernel else ''} writes {t.split('{')[0]}")
    return extra


def beyond_the_head(extra: list, head: str) -> list:
    """head_logit_passes' list without the one array the Pallas head writes between its two passes
    (head: pallas): head_softcap's bf16 sigmoids, which the reference's kernel keeps in shared memory.
    XLA's head writes none: its two passes read the GEMM's bf16 logits (train_gpt._fp8_logits)."""
    kept = [e for e in extra if "custom-call head_softcap writes bf16[" in e][:1] if head == "pallas" else []
    return [e for e in extra if e not in kept]


def fp32_activations(hlo_text: str, rows: int, widths: tuple) -> list:
    """Kernels other than GEMMs that write an fp32 activation, a (rows, width) array for a width in
    `widths` (the model's, the fused qkv's, the MLP's hidden), as text. The code keeps activations in
    bf16, as the reference does; XLA's GPU compiler had dropped their roundings where every reader
    converts them back to fp32 (excess precision: train_gpt.COMPILER_OPTIONS), storing them in fp32,
    unrounded, at twice the bytes. A GEMM's own fp32 output (an FP8 GEMM's, as the code asks) is no
    such kernel."""
    module = parse_hlo(hlo_text)
    found = []
    for comp, ins in _kernels(module):
        if _is_gemm(module, ins):
            continue
        for t in _array_types(ins.type):
            d = [n for n in dims(t) if n != 1]  # either way round, the width maybe split (heads x head dim)
            if element_type(t) == "f32" and len(d) >= 2 and (d[0] == rows and math.prod(d[1:]) in widths
                                                              or d[-1] == rows and math.prod(d[:-1]) in widths):
                found.append(f"{ins.name} in {comp}: {ins.op} writes {t.split('{')[0]}")
    return found


# Hand-written HLO in the printed formats, at small sizes: head dimension V = 96, T = 64, D = 32.
V = 96
CUBLAS_HLO = """HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(bf16[64,32]{1,0})->f32[]}

%fused_scale_x (param_0.1: bf16[64,32]) -> f8e4m3fn[64,32] {
  %param_0.1 = bf16[64,32]{1,0} parameter(0)
  %constant.1 = bf16[] constant(2)
  %broadcast.1 = bf16[64,32]{1,0} broadcast(%constant.1), dimensions={}
  %multiply.1 = bf16[64,32]{1,0} multiply(%param_0.1, %broadcast.1)
  ROOT %convert.1 = f8e4m3fn[64,32]{1,0} convert(%multiply.1), metadata={op_name="jit(train_step)/convert_element_type"}
}

ENTRY %main.9 (x.1: bf16[64,32], w8.1: f8e4m3fn[96,32], g8.1: f8e5m2[64,96], a.1: bf16[64,32], b.1: bf16[32,32]) -> f32[] {
  %x.1 = bf16[64,32]{1,0} parameter(0)
  %w8.1 = f8e4m3fn[96,32]{1,0} parameter(1)
  %g8.1 = f8e5m2[64,96]{1,0} parameter(2)
  %a.1 = bf16[64,32]{1,0} parameter(3)
  %b.1 = bf16[32,32]{1,0} parameter(4)
  %x8 = f8e4m3fn[64,32]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_scale_x
  %one = f32[] constant(1)
  %cublas-lt-matmul.1 = (bf16[64,96]{1,0}, s8[4194304]{0}) custom-call(%x8, %w8.1, %one, %one), custom_call_target="__cublas$lt$matmul$f8", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %transpose.2 = f8e4m3fn[32,96]{1,0} transpose(%w8.1), dimensions={1,0}
  %cublas-lt-matmul.2 = (f32[64,32]{1,0}, s8[4194304]{0}) custom-call(f8e5m2[64,96]{1,0} %g8.1, f8e4m3fn[32,96]{1,0} %transpose.2, f32[] %one, f32[] %one), custom_call_target="__cublas$lt$matmul$f8", backend_config={}
  %transpose.3 = f8e5m2[96,64]{1,0} transpose(%g8.1), dimensions={1,0}
  %transpose.4 = f8e4m3fn[32,64]{1,0} transpose(%x8), dimensions={1,0}
  %cublas-lt-matmul.3 = (f32[96,32]{1,0}, s8[4194304]{0}) custom-call(%transpose.3, %transpose.4, %one, %one), custom_call_target="__cublas$lt$matmul$f8"
  %cublas-gemm.4 = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(%a.1, %b.1), custom_call_target="__cublas$gemm", backend_config={}
  ROOT %r = f32[] constant(0)
}
"""

TRITON_HLO = """HloModule jit_train_step, is_scheduled=true

%lhs_block (parameter_0.1: f8e5m2[64,96]) -> f8e5m2[64,96] {
  ROOT %parameter_0.1 = f8e5m2[64,96]{1,0} parameter(0)
}

%rhs_block (parameter_0.2: f8e4m3fn[96,32]) -> f8e4m3fn[96,32] {
  ROOT %parameter_0.2 = f8e4m3fn[96,32]{1,0} parameter(0)
}

%gemm_fusion_dot.1_computation (parameter_0: f8e5m2[64,96], parameter_1: f8e4m3fn[96,32]) -> f32[64,32] {
  %parameter_0 = f8e5m2[64,96]{1,0} parameter(0)
  %block_fusion = f8e5m2[64,96]{1,0} fusion(%parameter_0), kind=kCustom, calls=%lhs_block, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"output_tiles":[{"sizes":["16","16"]}]}}}
  %parameter_1 = f8e4m3fn[96,32]{1,0} parameter(1)
  %block_fusion.1 = f8e4m3fn[96,32]{1,0} fusion(%parameter_1), kind=kCustom, calls=%rhs_block, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %dot.0 = f32[64,32]{1,0} dot(%block_fusion, %block_fusion.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_fusion_dot.2_computation (parameter_0.3: f8e4m3fn[64,32], parameter_1.3: f8e4m3fn[96,32]) -> f32[64,96] {
  %parameter_0.3 = f8e4m3fn[64,32]{1,0} parameter(0)
  %parameter_1.3 = f8e4m3fn[96,32]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,96]{1,0} dot(%parameter_0.3, %parameter_1.3), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%gemm_fusion_dot.3_computation (parameter_0.4: f8e5m2[64,96], parameter_1.4: f8e4m3fn[64,32]) -> f32[96,32] {
  %parameter_0.4 = f8e5m2[64,96]{1,0} parameter(0)
  %parameter_1.4 = f8e4m3fn[64,32]{1,0} parameter(1)
  ROOT %dot.2 = f32[96,32]{1,0} dot(%parameter_0.4, %parameter_1.4), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

ENTRY %main.2 (g8: f8e5m2[64,96], w8: f8e4m3fn[96,32], x8: f8e4m3fn[64,32]) -> (f32[64,32], f32[64,96], f32[96,32]) {
  %g8 = f8e5m2[64,96]{1,0} parameter(0)
  %w8 = f8e4m3fn[96,32]{1,0} parameter(1)
  %x8 = f8e4m3fn[64,32]{1,0} parameter(2)
  %gemm_fusion_dot.1 = f32[64,32]{1,0} fusion(%g8, %w8), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %gemm_fusion_dot.2 = f32[64,96]{1,0} fusion(%x8, %w8), kind=kCustom, calls=%gemm_fusion_dot.2_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64"}}}
  %gemm_fusion_dot.3 = f32[96,32]{1,0} fusion(%g8, %x8), kind=kCustom, calls=%gemm_fusion_dot.3_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %tuple = (f32[64,32]{1,0}, f32[64,96]{1,0}, f32[96,32]{1,0}) tuple(%gemm_fusion_dot.1, %gemm_fusion_dot.2, %gemm_fusion_dot.3)
}
"""

# What XLA:CPU (jax 0.11.2) printed for an f8 x f8 -> f32 dot_general, shapes adapted to V: the f8
# operands are converted back to f32 in loop fusions and a plain dot multiplies them.
EMULATED_HLO = """HloModule jit_f, is_scheduled=true, entry_computation_layout={(f32[64,32]{1,0}, f32[96,32]{1,0})->bf16[64,96]{1,0}}

FileNames
1 "/tmp/hlo_probe.py"

%fused_computation (param_0: f32[64,32], param_1: f32[96,32]) -> f32[64,96] {
  %param_0 = f32[64,32]{1,0} parameter(0)
  %param_1 = f32[96,32]{1,0} parameter(1)
  ROOT %dot_general.0 = f32[64,96]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}, metadata={op_name="jit(f)/dot_general" stack_frame_id=4}
}

%fused_computation.1 (param_0.2: f32[96,32]) -> f32[96,32] {
  %param_0.2 = f32[96,32]{1,0} parameter(0)
  %convert_element_type.0 = f8e4m3fn[96,32]{1,0} convert(%param_0.2), metadata={op_name="jit(f)/convert_element_type" stack_frame_id=3}
  ROOT %convert.2 = f32[96,32]{1,0} convert(%convert_element_type.0), metadata={op_name="jit(f)/dot_general" stack_frame_id=4}
}

%fused_computation.2 (param_0.4: f32[64,32]) -> f32[64,32] {
  %param_0.4 = f32[64,32]{1,0} parameter(0)
  %convert_element_type.1 = f8e4m3fn[64,32]{1,0} convert(%param_0.4), metadata={op_name="jit(f)/convert_element_type" stack_frame_id=2}
  ROOT %convert.3 = f32[64,32]{1,0} convert(%convert_element_type.1), metadata={op_name="jit(f)/dot_general" stack_frame_id=4}
}

ENTRY %main.1 (x.1: f32[64,32], w.1: f32[96,32]) -> bf16[64,96] {
  %x.1 = f32[64,32]{1,0} parameter(0), metadata={op_name="x"}
  %w.1 = f32[96,32]{1,0} parameter(1), metadata={op_name="w"}
  %convert_convert_fusion.1 = f32[64,32]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_computation.2
  %convert_convert_fusion = f32[96,32]{1,0} fusion(%w.1), kind=kLoop, calls=%fused_computation.1, backend_config={"outer_dimension_partitions":["2"]}
  %ynn_fusion = f32[64,96]{1,0} fusion(%convert_convert_fusion.1, %convert_convert_fusion), kind=kCustom, calls=%fused_computation, backend_config={"fusion_config":{"kind":"__ynn_fusion"},"outer_dimension_partitions":[]}
  ROOT %wrapped_convert = bf16[64,96]{1,0} convert(%ynn_fusion)
}
"""


# A fusion of six operands as XLA prints it: a comment before every fifth operand (and parameter).
SIX_OPERANDS_HLO = """HloModule jit_six, is_scheduled=true

%six (p0: f32[4], p1: f32[4], p2: f32[4], p3: f32[4], p4: f32[4], /*index=5*/p5: bf16[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %p2 = f32[4]{0} parameter(2)
  %p3 = f32[4]{0} parameter(3)
  %p4 = f32[4]{0} parameter(4)
  %p5 = bf16[4]{0} parameter(5)
  %s = f32[4]{0} add(%p0, %p1)
  %t = f32[4]{0} add(%p2, %p3)
  %u = f32[4]{0} add(%s, %t)
  %w = f32[4]{0} convert(%p5)
  ROOT %r = f32[4]{0} add(%u, %w)
}

ENTRY %main (a: f32[4], b: f32[4], c: f32[4], d: f32[4], e: f32[4], /*index=5*/f: bf16[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %c = f32[4]{0} parameter(2)
  %d = f32[4]{0} parameter(3)
  %e = f32[4]{0} parameter(4)
  %f = bf16[4]{0} parameter(5)
  ROOT %fused = f32[4]{0} fusion(%a, %b, %c, %d, %e, /*index=5*/%f), kind=kLoop, calls=%six
}
"""


# q and k of a fused qkv projection's output read by one kernel: through a bitcast and a convert, two
# slices of it, a third left unread.
QK_HLO = """HloModule jit_qk, is_scheduled=true

%qk (p0: bf16[4,12]) -> f32[4,8] {
  %p0 = bf16[4,12]{1,0} parameter(0)
  %b = bf16[4,3,4]{2,1,0} bitcast(%p0)
  %c = f32[4,3,4]{2,1,0} convert(%b)
  %q = f32[4,1,4]{2,1,0} slice(%c), slice={[0:4], [0:1], [0:4]}
  %k = f32[4,1,4]{2,1,0} slice(%c), slice={[0:4], [1:2], [0:4]}
  %qr = f32[4,4]{1,0} bitcast(%q)
  %kr = f32[4,4]{1,0} bitcast(%k)
  ROOT %r = f32[4,8]{1,0} concatenate(%qr, %kr), dimensions={1}
}

ENTRY %main (x: bf16[4,12]) -> f32[4,8] {
  %x = bf16[4,12]{1,0} parameter(0)
  ROOT %f = f32[4,8]{1,0} fusion(%x), kind=kLoop, calls=%qk
}
"""

def test_hlo_parser_reads_types_operands_and_calls():
    module = parse_hlo(CUBLAS_HLO)
    assert set(module.computations) == {"fused_scale_x", "main.9"}
    gemm = module.get("main.9", "cublas-lt-matmul.2")
    assert gemm.op == "custom-call" and gemm.type == "(f32[64,32]{1,0}, s8[4194304]{0})"
    assert gemm.operands == ["g8.1", "transpose.2", "one", "one"]  # typed operands give their names
    assert element_type(gemm.type) == "f32" and dims(gemm.type) == [64, 32]
    assert module.roots == {"fused_scale_x": "convert.1", "main.9": "r"}
    assert [c.name for c in module.callers["fused_scale_x"]] == ["x8"]
    # a computation may share its name with an instruction (nested Triton fusions do)
    triton = parse_hlo(TRITON_HLO)
    assert triton.get("gemm_fusion_dot.1_computation", "dot.0").operands == ["block_fusion", "block_fusion.1"]
    # the sixth operand follows XLA's /*index=5*/ comment: its name, not the comment's text
    assert parse_hlo(SIX_OPERANDS_HLO).get("main", "fused").operands == ["a", "b", "c", "d", "e", "f"]


def test_cublaslt_fp8_head_passes_and_bf16_gemms_elsewhere_are_ignored():
    heads, problems = fp8_gemm_problems(CUBLAS_HLO, V)
    assert problems == []
    assert [g.name for g in heads] == ["cublas-lt-matmul.1", "cublas-lt-matmul.2", "cublas-lt-matmul.3"]
    assert [(element_type(g.lhs), element_type(g.rhs)) for g in heads] == [
        ("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn")]


def test_cublaslt_fp8_head_writing_fp32_logits_or_scaling_them_otherwise_fails():
    """train_gpt._fp8_logits has cuBLASLt round the logits to bf16 itself, scaled by alpha x the two scales."""
    hlo = CUBLAS_HLO.replace("%cublas-lt-matmul.1 = (bf16[64,96]", "%cublas-lt-matmul.1 = (f32[64,96]")
    _, problems = fp8_gemm_problems(hlo, V)
    assert len(problems) == 1 and "cublas-lt-matmul.1" in problems[0] and "logits in f32, not bf16" in problems[0]
    line = next(l for l in CUBLAS_HLO.splitlines() if "%cublas-lt-matmul.1 =" in l)
    scaled = line.replace("%one, %one)", "%sx, %sw)").replace('"alpha_real":1,', '"alpha_real":0.96484375,')
    hlo = CUBLAS_HLO.replace(line, "  %sx = f32[] constant(0.2265625)\n  %sw = f32[] constant(0.00364685059)\n" + scaled)
    u_s = 0.2265625 * 0.0036468505859375 * 0.96484375
    assert fp8_gemm_problems(hlo, V, dequant=u_s)[1] == [] and fp8_gemm_problems(CUBLAS_HLO, V, dequant=1.0)[1] == []
    for wrong in (u_s * (1 + 2.3e-5), 1.0):  # two bf16 factors' best; alpha and scales 1
        assert [p for p in fp8_gemm_problems(hlo, V, dequant=wrong)[1] if "not" in p and "in all" in p], wrong
    hlo = hlo.replace("%sw = f32[] constant(0.00364685059)", "%sw = f32[] parameter(5)")
    assert "[0.96484375, 0.2265625, None]" in fp8_gemm_problems(hlo, V, dequant=u_s)[1][0]  # a scale not a constant


def test_triton_fp8_gemm_fusions_pass():
    heads, problems = fp8_gemm_problems(TRITON_HLO, V)
    assert problems == []
    assert [g.kernel for g in heads] == ["__triton_nested_gemm_fusion", "__triton_gemm", "__triton_gemm"]


def test_a_pallas_kernel_is_a_gemm_by_its_name_and_a_pass_over_the_logits_is_named():
    """train_gpt's Pallas GEMM kernels (Triton custom calls named mlp_up, mlp_dpre) count as GEMMs, here in
    the head forward's place, their bf16 output as a GEMM's; another Pallas kernel (the head's
    head_softcap pass) is no GEMM, and a logit-sized array it writes is reported under its name."""
    line = next(l for l in CUBLAS_HLO.splitlines() if "%cublas-lt-matmul.1 =" in l)
    pallas = ('  %head = (bf16[64,96]{1,0}, f32[64,1]{1,0}) custom-call(%x8, %w8.1), custom_call_target='
              '"__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 1 : i32, name = "mlp_up", '
              'num_warps = 8 : i32}')
    hlo = CUBLAS_HLO.replace(line, pallas)
    heads, problems = fp8_gemm_problems(hlo, V)
    assert problems == [] and [g.kernel for g in heads] == ["pallas mlp_up", CUBLAS_FP8, CUBLAS_FP8]
    assert head_logit_passes(hlo, V, 64) == []
    other = hlo.replace('name = "mlp_up"', 'name = "head_softcap"')
    heads, problems = fp8_gemm_problems(other, V)
    assert len(heads) == 2 and any("2 head matmuls" in p for p in problems)
    assert head_logit_passes(other, V, 64) == ["head in main.9: custom-call head_softcap writes bf16[64,96]"]


def test_non_fp8_cublas_kernel_for_a_head_matmul_fails():
    hlo = CUBLAS_HLO.replace('custom_call_target="__cublas$lt$matmul$f8"', 'custom_call_target="__cublas$lt$matmul"', 1)
    _, problems = fp8_gemm_problems(hlo, V)
    assert len(problems) == 1 and "cublas-lt-matmul.1" in problems[0] and "__cublas$lt$matmul," in problems[0]


def test_f8_upcast_to_bf16_before_a_cublas_gemm_fails():
    """The GPU fallback: f8 converted back to bf16 in a fusion, then a bf16 GEMM."""
    upcast = CUBLAS_HLO.replace(
        "  ROOT %convert.1 = f8e4m3fn[64,32]{1,0} convert(%multiply.1)",
        "  %convert.1 = f8e4m3fn[64,32]{1,0} convert(%multiply.1)\n"
        "  ROOT %convert.9 = bf16[64,32]{1,0} convert(%convert.1)",
    ).replace("-> f8e4m3fn[64,32] {", "-> bf16[64,32] {").replace(
        "%x8 = f8e4m3fn[64,32]{1,0} fusion", "%x8 = bf16[64,32]{1,0} fusion").replace(
        "%transpose.4 = f8e4m3fn[32,64]", "%transpose.4 = bf16[32,64]")
    heads, problems = fp8_gemm_problems(upcast, V)
    assert len(heads) == 3
    text = "\n".join(problems)
    # forward: bf16 x f8 operands, the bf16 one upcast; dw: the transposed upcast x8
    assert "cublas-lt-matmul.1" in text and "bf16 x f8e4m3fn operands, not FP8" in text
    assert "operand 0 (x8) is an f8 tensor upcast" in text
    assert "operand 1 (transpose.4) is an f8 tensor upcast" in text
    assert "forward is not FP8" in text
    assert "cublas-lt-matmul.2" not in text  # dx reads g8 and w8: still FP8


def test_convert_inside_a_triton_gemm_fusion_fails():
    """f8 parameters, but the fusion converts them to bf16 before its dot."""
    inside = TRITON_HLO.replace(
        "  ROOT %parameter_0.2 = f8e4m3fn[96,32]{1,0} parameter(0)",
        "  %parameter_0.2 = f8e4m3fn[96,32]{1,0} parameter(0)\n"
        "  ROOT %convert.5 = bf16[96,32]{1,0} convert(%parameter_0.2)",
    ).replace("%block_fusion.1 = f8e4m3fn[96,32]", "%block_fusion.1 = bf16[96,32]")
    _, problems = fp8_gemm_problems(inside, V)
    assert len(problems) == 2, problems
    assert "dot.0" in problems[0] and "operand 1 (block_fusion.1) is an f8 tensor upcast" in problems[0]
    assert "dot.0" in problems[1] and "f8e5m2 x bf16 operands, not FP8" in problems[1]


def test_emulated_fp8_as_xla_cpu_compiles_it_fails():
    heads, problems = fp8_gemm_problems(EMULATED_HLO, V, min_count=1)
    assert [g.kernel for g in heads] == ["dot"]  # __ynn_fusion is no GPU GEMM kernel
    text = "\n".join(problems)
    assert "operand 0 (param_0) is an f8 tensor upcast" in text  # through the fusion parameter to its caller
    assert "operand 1 (param_1) is an f8 tensor upcast" in text
    assert "f32 x f32 operands, not FP8" in text


def test_missing_backward_or_too_few_head_matmuls_fail():
    forward_only = "\n".join(line for line in CUBLAS_HLO.splitlines()
                             if "cublas-lt-matmul.2" not in line and "cublas-lt-matmul.3" not in line)
    heads, problems = fp8_gemm_problems(forward_only, V)
    assert len(heads) == 1
    assert any("1 head matmuls" in p for p in problems)
    assert any("backward is not FP8" in p for p in problems)
    assert fp8_gemm_problems(CUBLAS_HLO, V, min_count=4)[1] == [
        f"3 head matmuls (a dimension of {V}) found, expected at least 4: forward, dx and dw"]


def test_plain_dot_on_f8_operands_fails():
    """f8 operands but no GEMM kernel: a dot left outside any GEMM fusion."""
    hlo = TRITON_HLO.replace('"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64"}', '"kind":"__loop"')
    _, problems = fp8_gemm_problems(hlo, V)
    assert len(problems) == 1 and "dot.1" in problems[0] and "plain dot" in problems[0]


# The head's logit-sized kernels, in the shape XLA (jax 0.11.2, H100) compiled a loop over loss chunks
# of 64 rows (as the train head ran before 2026-11-27; validation's still does): the FP8 GEMM's bf16
# logits, a loop fusion that computes the softcap's sigmoid into bf16 (the pass the checker must find),
# the e5m2 gradient written into the stacked output in place; fp32 values inside a fused computation
# stay in registers.
HEAD_HLO = """HloModule jit_train_step, is_scheduled=true

%gemm (p0: f8e4m3fn[64,32], p1: f8e4m3fn[32,96]) -> bf16[64,96] {
  %p0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %p1 = f8e4m3fn[32,96]{1,0} parameter(1)
  %d = f32[64,96]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %c = bf16[64,96]{1,0} convert(%d)
}

%sigmoid (p2: bf16[64,96]) -> bf16[64,96] {
  %p2 = bf16[64,96]{1,0} parameter(0)
  %f = f32[64,96]{1,0} convert(%p2)
  %l = f32[64,96]{1,0} logistic(%f)
  ROOT %b = bf16[64,96]{1,0} convert(%l)
}

%grad (p3: f8e5m2[2,64,96], p4: bf16[64,96], p5: s32[]) -> f8e5m2[2,64,96] {
  %p3 = f8e5m2[2,64,96]{2,1,0} parameter(0)
  %p4 = bf16[64,96]{1,0} parameter(1)
  %g = f8e5m2[1,64,96]{2,1,0} convert(%p4)
  %p5 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f8e5m2[2,64,96]{2,1,0} dynamic-update-slice(%p3, %g, %p5, %z, %z)
}

%body (s: (s32[], f8e5m2[2,64,96], f8e4m3fn[64,32], f8e4m3fn[32,96])) -> (s32[], f8e5m2[2,64,96], f8e4m3fn[64,32], f8e4m3fn[32,96]) {
  %s = (s32[], f8e5m2[2,64,96]{2,1,0}, f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,96]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %acc = f8e5m2[2,64,96]{2,1,0} get-tuple-element(%s), index=1
  %x8 = f8e4m3fn[64,32]{1,0} get-tuple-element(%s), index=2
  %w8 = f8e4m3fn[32,96]{1,0} get-tuple-element(%s), index=3
  %gemm_fusion = bf16[64,96]{1,0} fusion(%x8, %w8), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %pair = (bf16[64,96]{1,0}, bf16[64,96]{1,0}) tuple(%gemm_fusion, %gemm_fusion)
  %barrier = (bf16[64,96]{1,0}, bf16[64,96]{1,0}) opt-barrier((bf16[64,96]{1,0}, bf16[64,96]{1,0}) %pair)
  %u1 = bf16[64,96]{1,0} get-tuple-element(%barrier), index=1
  %loop_convert_fusion = bf16[64,96]{1,0} fusion(%u1), kind=kLoop, calls=%sigmoid
  %dus_fusion = f8e5m2[2,64,96]{2,1,0} fusion(%acc, %loop_convert_fusion, %i), kind=kLoop, calls=%grad
  ROOT %t = (s32[], f8e5m2[2,64,96]{2,1,0}, f8e4m3fn[64,32]{1,0}, f8e4m3fn[32,96]{1,0}) tuple(%i, %dus_fusion, %x8, %w8)
}
"""


def test_only_the_pallas_head_may_write_one_logit_sized_array_its_sigmoids():
    f32 = "gemm in body: custom-call writes f32[64,96]"  # cuBLASLt's fp32 logits: _fp8_logits' pattern lost
    fusion = "loop_convert_fusion in body: fusion writes bf16[64,96]"
    kernel = "pallas_call.1 in body: custom-call head_softcap writes bf16[64,96]"
    assert beyond_the_head([kernel], "pallas") == [] and beyond_the_head([], "xla") == []
    assert beyond_the_head([kernel], "xla") == [kernel]  # XLA's head keeps no sigmoids
    assert beyond_the_head([f32, fusion], "xla") == [f32, fusion]  # nor fp32 logits and a pass rounding them
    assert beyond_the_head([f32, kernel], "pallas") == [f32]
    again = kernel.replace("pallas_call.1", "pallas_call.2")
    assert beyond_the_head([kernel, again], "pallas") == [again]  # one, nothing else


def test_a_kernel_storing_an_fp32_activation_is_found_and_gemms_outputs_are_not():
    hlo = """HloModule jit_train_step, is_scheduled=true

%fused_residual (param_0.1: bf16[64,32], param_1.1: f32[64,32]) -> f32[64,32] {
  %param_0.1 = bf16[64,32]{1,0} parameter(0)
  %convert.1 = f32[64,32]{1,0} convert(%param_0.1)
  %param_1.1 = f32[64,32]{1,0} parameter(1)
  ROOT %add.1 = f32[64,32]{1,0} add(%convert.1, %param_1.1)
}

ENTRY %main.9 (x.1: bf16[64,32], w.1: bf16[32,32], w8.1: f8e4m3fn[32,96]) -> f32[] {
  %x.1 = bf16[64,32]{1,0} parameter(0)
  %w.1 = bf16[32,32]{1,0} parameter(1)
  %gemm = (f32[64,32]{1,0}, s8[1024]{0}) custom-call(%x.1, %w.1), custom_call_target="__cublas$lt$matmul"
  %h = f32[64,32]{1,0} get-tuple-element(%gemm), index=0
  %residual = f32[64,32]{1,0} fusion(%x.1, %h), kind=kLoop, calls=%fused_residual
  %rounded = bf16[64,32]{1,0} fusion(%x.1, %h), kind=kLoop, calls=%fused_residual
  %norm = (f32[64]{0}, f32[64,96]{1,0}, /*index=2*/f32[64,128]{1,0}) fusion(%x.1, %h), kind=kInput, calls=%fused_residual
  %sums = f32[64]{0} fusion(%x.1, %h), kind=kInput, calls=%fused_residual
  %sliced = (f32[64,32]{1,0}, s8[1024]{0}) fusion(%x.1, %w.1), kind=kCustom, calls=%sliced_gemm, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion"}}}
  %heads = f32[64,4,8]{2,1,0} fusion(%x.1, %h), kind=kLoop, calls=%fused_residual
  %xt = f32[32,64]{1,0} fusion(%x.1, %h), kind=kLoop, calls=%fused_residual
  ROOT %r = f32[] constant(0)
}

%sliced_gemm (p0: bf16[64,32], p1: bf16[32,32]) -> (f32[64,32], s8[1024]) {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,32]{1,0} parameter(1)
  ROOT %g = (f32[64,32]{1,0}, s8[1024]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$lt$matmul"
}
"""
    stored = ["residual in main.9: fusion writes f32[64,32]", "norm in main.9: fusion writes f32[64,96]",
              "heads in main.9: fusion writes f32[64,4,8]", "xt in main.9: fusion writes f32[32,64]"]
    assert fp32_activations(hlo, 64, (32, 96)) == stored  # a GEMM's output, in a dynamic-slice fusion too: none
    assert fp32_activations(hlo, 64, (128,)) == ["norm in main.9: fusion writes f32[64,128]"]
    assert fp32_activations(hlo, 16, (32, 96)) == []  # other rows: not an activation of this chunk


def test_a_pass_over_the_heads_logits_beyond_the_gemm_and_the_gradient_is_found():
    assert head_logit_passes(HEAD_HLO, V, 64) == ["loop_convert_fusion in body: fusion writes bf16[64,96]"]
    fused = re.sub(r"%sigmoid .*?\n}\n", "", HEAD_HLO, flags=re.S).replace(
        "fusion(%acc, %loop_convert_fusion, %i)", "fusion(%acc, %u1, %i)").replace(
        "  %loop_convert_fusion = bf16[64,96]{1,0} fusion(%u1), kind=kLoop, calls=%sigmoid\n", "")
    assert head_logit_passes(fused, V, 64) == []  # the sigmoid computed inside the gradient's kernel
    # the sigmoid as a multi-output kernel's 6th output, after XLA's /*index=5*/ comment: found too
    sixth = HEAD_HLO.replace("%loop_convert_fusion = bf16[64,96]{1,0} fusion(",
                             "%loop_convert_fusion = (f32[]{}, f32[]{}, f32[]{}, f32[]{}, f32[]{}, "
                             "/*index=5*/bf16[64,96]{1,0}) fusion(")
    assert "/*index=5*/bf16[64,96]" in sixth
    assert head_logit_passes(sixth, V, 64) == ["loop_convert_fusion in body: fusion writes bf16[64,96]"]
    as_f32 = HEAD_HLO.replace("%loop_convert_fusion = bf16[64,96]{1,0}", "%loop_convert_fusion = f32[64,96]{1,0}")
    assert head_logit_passes(as_f32, V, 64) == ["loop_convert_fusion in body: fusion writes f32[64,96]"]
    f32_gemm = HEAD_HLO.replace("%gemm_fusion = bf16[64,96]{1,0}", "%gemm_fusion = f32[64,96]{1,0}")
    assert "gemm_fusion in body: fusion writes f32[64,96]" in head_logit_passes(f32_gemm, V, 64)
    assert head_logit_passes(HEAD_HLO, V, 32) == []  # another chunk's rows
    multi = HEAD_HLO.replace("%loop_convert_fusion = bf16[64,96]{1,0}", "%loop_convert_fusion = (f32[64]{0}, f32[64,96]{1,0})")
    assert head_logit_passes(multi, V, 64) == ["loop_convert_fusion in body: fusion writes f32[64,96]"]  # multi-output
    transposed = HEAD_HLO.replace("%loop_convert_fusion = bf16[64,96]{1,0}", "%loop_convert_fusion = bf16[96,64]{0,1}")
    assert head_logit_passes(transposed, V, 64) == ["loop_convert_fusion in body: fusion writes bf16[96,64]"]
    cublas = HEAD_HLO.replace(
        '%gemm_fusion = bf16[64,96]{1,0} fusion(%x8, %w8), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}',
        '%gemm_fusion = (f32[64,96]{1,0}, s8[1024]{0}) custom-call(%x8, %w8), custom_call_target="__cublas$lt$matmul$f8"')
    assert "gemm_fusion in body: custom-call writes f32[64,96]" in head_logit_passes(cublas, V, 64)  # fp32 logits
    assert "gemm_fusion" not in " ".join(head_logit_passes(cublas.replace("(f32[64,96]", "(bf16[64,96]"), V, 64))
    # validation's head: the bf16 GEMM inside XLA's dynamic-slice fusion, reading its rows of x in place
    sliced = re.sub(r"%gemm .*?\n}\n", "", cublas, flags=re.S).replace("__cublas$lt$matmul$f8", "__cublas$lt$matmul")
    sliced = sliced.replace("(f32[64,96]", "(bf16[64,96]")
    sliced = sliced.replace('%gemm_fusion = (bf16[64,96]{1,0}, s8[1024]{0}) custom-call(%x8, %w8), '
                            'custom_call_target="__cublas$lt$matmul"',
                            "%gemm_fusion = (bf16[64,96]{1,0}, s8[1024]{0}) fusion(%x8, %w8), kind=kCustom, calls=%sliced, "
                            'backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":'
                            '{"name":"dynamic_slice_fusion","kernel_index":0}}}')
    sliced = sliced.replace("%body (", """%sliced (d0: f8e4m3fn[64,32], d1: f8e4m3fn[32,96]) -> (bf16[64,96], s8[1024]) {
  %d0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %d1 = f8e4m3fn[32,96]{1,0} parameter(1)
  ROOT %call = (bf16[64,96]{1,0}, s8[1024]{0}) custom-call(%d0, %d1), custom_call_target="__cublas$lt$matmul"
}

%body (""", 1)
    assert head_logit_passes(sliced, V, 64) == ["loop_convert_fusion in body: fusion writes bf16[64,96]"]
    other = sliced.replace('"name":"dynamic_slice_fusion"', '"name":"some_other_fusion"')
    assert "gemm_fusion in body: fusion writes bf16[64,96]" in head_logit_passes(other, V, 64)
    no_gemm = sliced.replace('custom-call(%d0, %d1), custom_call_target="__cublas$lt$matmul"',
                             'custom-call(%d0, %d1), custom_call_target="some_library_call"')
    assert "gemm_fusion in body: fusion writes bf16[64,96]" in head_logit_passes(no_gemm, V, 64)


# tests/gpu/aot.py's static traffic estimate, on a hand-written module: a loop of 4 trips reads one
# row of a stacked f32[4,64] (a 256-byte slice) and writes it into a buffer in place; the entry runs a
# bf16 GEMM fusion (32 x 64 times 64 x 16). Frames: step:20 calls matmul:10 and read_row:5.
TRAFFIC_HLO = """HloModule jit_step, is_scheduled=true

%read (p0: f32[4,64], p1: s32[]) -> f32[64] {
  %p0 = f32[4,64]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %row = f32[1,64]{1,0} dynamic-slice(f32[4,64]{1,0} %p0, s32[] %p1, s32[] %zero), dynamic_slice_sizes={1,64}
  ROOT %flat = f32[64]{0} reshape(f32[1,64]{1,0} %row)
}

%write (q0: f32[4,64], q1: f32[64], q2: s32[]) -> f32[4,64] {
  %q0 = f32[4,64]{1,0} parameter(0)
  %q1 = f32[64]{0} parameter(1)
  %q2 = s32[] parameter(2)
  %zero.1 = s32[] constant(0)
  %up = f32[1,64]{1,0} reshape(f32[64]{0} %q1)
  ROOT %dus = f32[4,64]{1,0} dynamic-update-slice(f32[4,64]{1,0} %q0, f32[1,64]{1,0} %up, s32[] %q2, s32[] %zero.1)
}

%gemm (x: bf16[32,64], w: bf16[64,16]) -> f32[32,16] {
  %x = bf16[32,64]{1,0} parameter(0)
  %w = bf16[64,16]{1,0} parameter(1)
  ROOT %d = f32[32,16]{1,0} dot(bf16[32,64]{1,0} %x, bf16[64,16]{1,0} %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (s: (s32[], f32[4,64], f32[4,64])) -> (s32[], f32[4,64], f32[4,64]) {
  %s = (s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) %s), index=0
  %a = f32[4,64]{1,0} get-tuple-element((s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) %s), index=1
  %acc = f32[4,64]{1,0} get-tuple-element((s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) %s), index=2
  %r = f32[64]{0} fusion(f32[4,64]{1,0} %a, s32[] %i), kind=kLoop, calls=%read, metadata={op_name="r" stack_frame_id=3}
  %u = f32[4,64]{1,0} fusion(f32[4,64]{1,0} %acc, f32[64]{0} %r, s32[] %i), kind=kLoop, calls=%write, metadata={op_name="u" stack_frame_id=3}
  ROOT %t = (s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) tuple(s32[] %i, f32[4,64]{1,0} %a, f32[4,64]{1,0} %u)
}

%cond (c: (s32[], f32[4,64], f32[4,64])) -> pred[] {
  %c = (s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) parameter(0)
  ROOT %yes = pred[] constant(true)
}

ENTRY %main (a.1: f32[4,64], x.1: bf16[32,64], w.1: bf16[64,16]) -> f32[32,16] {
  %a.1 = f32[4,64]{1,0} parameter(0)
  %x.1 = bf16[32,64]{1,0} parameter(1)
  %w.1 = bf16[64,16]{1,0} parameter(2)
  %i0 = s32[] constant(0)
  %init = (s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) tuple(s32[] %i0, f32[4,64]{1,0} %a.1, f32[4,64]{1,0} %a.1)
  %loop = (s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) while((s32[], f32[4,64]{1,0}, f32[4,64]{1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %g = f32[32,16]{1,0} fusion(bf16[32,64]{1,0} %x.1, bf16[64,16]{1,0} %w.1), kind=kCustom, calls=%gemm, metadata={op_name="g" stack_frame_id=2}
}

FileNames
1 "model.py"

FunctionNames
1 "step"
2 "matmul"
3 "read_row"

FileLocations
1 {file_name_id=1 function_name_id=1 line=20 end_line=20 column=1 end_column=9}
2 {file_name_id=1 function_name_id=2 line=10 end_line=10 column=1 end_column=9}
3 {file_name_id=1 function_name_id=3 line=5 end_line=5 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=2}
"""


# Two scatter-adds of 8 rows of 64 fp32 into a (1000, 64) table: into the table the fusion is given
# (its buffer updated in place, as the train step adds the embedding rows' gradients to its sums), and
# into zeros made inside the fusion (the whole table written). Frames: rows:7 and zeros:8.
SCATTER_HLO = """HloModule jit_step, is_scheduled=true

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%into_table (t0: f32[1000,64], t1: s32[8,1], t2: f32[8,64]) -> f32[1000,64] {
  %t0 = f32[1000,64]{1,0} parameter(0)
  %t1 = s32[8,1]{1,0} parameter(1)
  %t2 = f32[8,64]{1,0} parameter(2)
  ROOT %sc = f32[1000,64]{1,0} scatter(f32[1000,64]{1,0} %t0, s32[8,1]{1,0} %t1, f32[8,64]{1,0} %t2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%sum
}

%into_zeros (z1: s32[8,1], z2: f32[8,64]) -> f32[1000,64] {
  %z1 = s32[8,1]{1,0} parameter(0)
  %z2 = f32[8,64]{1,0} parameter(1)
  %c = f32[] constant(0)
  %b = f32[1000,64]{1,0} broadcast(f32[] %c), dimensions={}
  ROOT %sc2 = f32[1000,64]{1,0} scatter(f32[1000,64]{1,0} %b, s32[8,1]{1,0} %z1, f32[8,64]{1,0} %z2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%sum
}

ENTRY %main (t: f32[1000,64], i: s32[8,1], u: f32[8,64]) -> (f32[1000,64], f32[1000,64]) {
  %t = f32[1000,64]{1,0} parameter(0)
  %i = s32[8,1]{1,0} parameter(1)
  %u = f32[8,64]{1,0} parameter(2)
  %in_place = f32[1000,64]{1,0} fusion(f32[1000,64]{1,0} %t, s32[8,1]{1,0} %i, f32[8,64]{1,0} %u), kind=kInput, calls=%into_table, metadata={op_name="a" stack_frame_id=1}
  %fresh = f32[1000,64]{1,0} fusion(s32[8,1]{1,0} %i, f32[8,64]{1,0} %u), kind=kInput, calls=%into_zeros, metadata={op_name="b" stack_frame_id=2}
  ROOT %out = (f32[1000,64]{1,0}, f32[1000,64]{1,0}) tuple(f32[1000,64]{1,0} %in_place, f32[1000,64]{1,0} %fresh)
}

FileNames
1 "model.py"

FunctionNames
1 "rows"
2 "zeros"

FileLocations
1 {file_name_id=1 function_name_id=1 line=7 end_line=7 column=1 end_column=9}
2 {file_name_id=1 function_name_id=2 line=8 end_line=8 column=1 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
"""


def test_traffic_estimate_counts_slices_in_place_updates_trips_and_gemm_flops():
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    from aot import traffic

    per_trip = (256 + 4 + 256) + (0 + 256 + 4 + 256)  # read: slice, index, row; write: in place, row, index, update
    rows, unknown = traffic(TRAFFIC_HLO)
    assert rows == {"read_row:5 < step:20": [4 * per_trip, 0, 8, 0, 0],  # (nothing sent to other devices)
                    "matmul:10 < step:20": [32 * 64 * 2 + 64 * 16 * 2 + 32 * 16 * 4, 2 * 32 * 16 * 64, 1, 0, 0]}
    assert unknown == []
    rows, unknown = traffic(TRAFFIC_HLO.replace(', backend_config={"known_trip_count":{"n":"4"}}', ""))
    assert rows["read_row:5 < step:20"] == [per_trip, 0, 2, 0, 0] and unknown == ["loop"]  # counted once, and said
    # cuBLAS's GEMMs count 2·M·N·K from their result and their dimension numbers (the first call's, the
    # only one that has them: x8 (64 x 32) times w8 (96 x 32) summed over 32), and so do train_gpt's
    # Pallas GEMM kernels, from their first two operands: here in place of that call
    line = next(l for l in CUBLAS_HLO.splitlines() if "%cublas-lt-matmul.1 =" in l)
    pallas = ('  %head = (bf16[64,96]{1,0}, f32[64,1]{1,0}) custom-call(%x8, %w8.1), custom_call_target='
              '"__gpu$xla.gpu.triton", backend_config={name = "mlp_up"}')
    assert traffic(CUBLAS_HLO.replace(line, pallas))[0]["?"][1] == 2 * 64 * 96 * 32
    # a scatter into its fusion's operand updates that buffer in place: the rows it adds are read and
    # written (and the indices and updates read), not the table; into zeros of its own, the table is written
    rows, _ = traffic(SCATTER_HLO)
    assert rows == {"rows:7": [32 + 2048 + 2 * 2048, 0, 1, 0, 0], "zeros:8": [32 + 2048 + 1000 * 64 * 4, 0, 1, 0, 0]}
    assert traffic(CUBLAS_HLO)[0]["?"][1] == 2 * 64 * 96 * 32
    # a cuBLAS call inside XLA's dynamic-slice fusion (reading one matrix of a bank in place): its FLOPs,
    # and its line the call's (the fusion has none), not the slice's
    sliced = TRAFFIC_HLO.replace(
        "  ROOT %g = f32[32,16]{1,0} fusion(bf16[32,64]{1,0} %x.1, bf16[64,16]{1,0} %w.1), kind=kCustom, calls=%gemm, "
        'metadata={op_name="g" stack_frame_id=2}',
        "  %bank = bf16[3,64,16]{2,1,0} parameter(3)\n"
        "  ROOT %g = (f32[32,16]{1,0}, s8[64]{0}) fusion(bf16[32,64]{1,0} %x.1, bf16[3,64,16]{2,1,0} %bank), "
        "kind=kCustom, calls=%sliced_gemm").replace("%gemm (x: bf16[32,64], w: bf16[64,16]) -> f32[32,16] {", """\
%sliced_gemm (x: bf16[32,64], b: bf16[3,64,16]) -> (f32[32,16], s8[64]) {
  %x = bf16[32,64]{1,0} parameter(0)
  %b = bf16[3,64,16]{2,1,0} parameter(1)
  %one = bf16[1,64,16]{2,1,0} slice(%b), slice={[1:2], [0:64], [0:16]}, metadata={op_name="s" stack_frame_id=3}
  %w = bf16[64,16]{1,0} bitcast(%one)
  ROOT %c = (f32[32,16]{1,0}, s8[64]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul", \
metadata={op_name="c" stack_frame_id=2}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":\
{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}

%gemm_unused (x: bf16[32,64], w: bf16[64,16]) -> f32[32,16] {""")
    assert traffic(sliced)[0]["matmul:10 < step:20"] == [32 * 64 * 2 + 64 * 16 * 2 + 32 * 16 * 4 + 64, 2 * 32 * 16 * 64,
                                                          1, 0, 0]
    wrapped = sliced.replace("  ROOT %c = (f32[32,16]{1,0}, s8[64]{0}) custom-call(", "  %c = (f32[32,16]{1,0}, s8[64]{0}) custom-call(")
    wrapped = wrapped.replace('{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}\n}',
                              '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}\n'
                              '  ROOT %t = ((f32[32,16]{1,0}, s8[64]{0})) tuple(%c)\n}')
    assert "ROOT %t" in wrapped  # a fusion whose root is a tuple: its call's line too, not its slice's
    assert traffic(wrapped)[0] == traffic(sliced)[0]
    # every operand counts, the sixth (after XLA's comment) too: five f32[4] and a bf16[4] read, f32[4] written
    assert traffic(SIX_OPERANDS_HLO)[0] == {"?": [5 * 16 + 8 + 16, 0, 1, 0, 0]}
    # slices read through a bitcast and a convert: their elements in the operand's type (two of qkv's
    # three 4 x 4 bf16 parts), not the whole operand; read whole when a use does not slice it
    assert traffic(QK_HLO)[0] == {"?": [2 * 16 * 2 + 4 * 8 * 4, 0, 1, 0, 0]}
    whole = QK_HLO.replace("  ROOT %r = f32[4,8]{1,0} concatenate(%qr, %kr), dimensions={1}",
                           "  %r = f32[4,8]{1,0} concatenate(%qr, %kr), dimensions={1}\n"
                           "  %all = f32[4,12]{1,0} convert(%p0)\n"
                           "  ROOT %t = (f32[4,8]{1,0}, f32[4,12]{1,0}) tuple(%r, %all)")
    assert traffic(whole)[0]["?"][0] == 4 * 12 * 2 + 4 * 8 * 4 + 4 * 12 * 4
    # converted straight into the kernel's output: read whole (nothing after the convert slices it)
    converted = QK_HLO.replace("  ROOT %r = f32[4,8]{1,0} concatenate(%qr, %kr), dimensions={1}",
                               "  %r = f32[4,8]{1,0} concatenate(%qr, %kr), dimensions={1}\n"
                               "  ROOT %all = f32[4,12]{1,0} convert(%p0)").replace("-> f32[4,8] {", "-> f32[4,12] {")
    assert traffic(converted.replace("ROOT %f = f32[4,8]{1,0}", "ROOT %f = f32[4,12]{1,0}"))[0]["?"][0] == \
        4 * 12 * 2 + 4 * 12 * 4


# Collectives among 8 devices as XLA's GPU compiler leaves them, asynchronous (a start and a done) or
# not: the gradients' all-reduce (psum:30), a reduce-scatter of them to 8 shares (scatter:40), and in
# one branch of a conditional an all-gather of a bf16 share in groups of 2 (gather:50, synchronous: only
# its shapes say the group; the other branch stacks the share twice, pad:60); then the update reads the
# sum (step:20).
FRAMES = [("psum", 30), ("step", 20), ("scatter", 40), ("gather", 50), ("pad", 60)]
COLLECTIVES_HLO = """HloModule jit_step, is_scheduled=true

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %x, f32[] %y)
}

%gathered (a: bf16[128,256]) -> bf16[256,256] {
  %a = bf16[128,256]{1,0} parameter(0)
  ROOT %ag = bf16[256,256]{1,0} all-gather(bf16[128,256]{1,0} %a), channel_id=3, replica_groups=mesh['dp'=8] {'dp':(4)2}, dimensions={0}, metadata={op_name="ag" stack_frame_id=4}
}

%stacked (b: bf16[128,256]) -> bf16[256,256] {
  %b = bf16[128,256]{1,0} parameter(0)
  ROOT %twice = bf16[256,256]{1,0} concatenate(bf16[128,256]{1,0} %b, bf16[128,256]{1,0} %b), dimensions={0}, metadata={op_name="pad" stack_frame_id=5}
}

ENTRY %main (g: f32[1024,256], p: f32[1024,256], h: bf16[128,256], odd: pred[]) -> (f32[1024,256], f32[128,256], bf16[256,256]) {
  %g = f32[1024,256]{1,0} parameter(0)
  %p = f32[1024,256]{1,0} parameter(1)
  %h = bf16[128,256]{1,0} parameter(2)
  %odd = pred[] parameter(3)
  %ars = ((f32[1024,256]{1,0}), f32[1024,256]{1,0}) all-reduce-start(f32[1024,256]{1,0} %g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum, metadata={op_name="psum" stack_frame_id=1}
  %ard = f32[1024,256]{1,0} all-reduce-done(((f32[1024,256]{1,0}), f32[1024,256]{1,0}) %ars), metadata={op_name="psum" stack_frame_id=1}
  %rss = ((f32[1024,256]{1,0}), f32[128,256]{1,0}) reduce-scatter-start(f32[1024,256]{1,0} %g), channel_id=2, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%sum, metadata={op_name="rs" stack_frame_id=3}
  %rsd = f32[128,256]{1,0} reduce-scatter-done(((f32[1024,256]{1,0}), f32[128,256]{1,0}) %rss), metadata={op_name="rs" stack_frame_id=3}
  %agd = bf16[256,256]{1,0} conditional(pred[] %odd, bf16[128,256]{1,0} %h, bf16[128,256]{1,0} %h), true_computation=%gathered, false_computation=%stacked
  %new = f32[1024,256]{1,0} subtract(f32[1024,256]{1,0} %p, f32[1024,256]{1,0} %ard), metadata={op_name="sub" stack_frame_id=2}
  ROOT %out = (f32[1024,256]{1,0}, f32[128,256]{1,0}, bf16[256,256]{1,0}) tuple(%new, %rsd, %agd)
}

FileNames
1 "model.py"
""" + "\n".join([  # frame k: function k at its line, called from frame 1
    "\nFunctionNames", *(f'{k} "{f}"' for k, (f, _) in enumerate(FRAMES, 1)),
    "\nFileLocations", *(f"{k} {{file_name_id=1 function_name_id={k} line={line} end_line={line} column=1 end_column=9}}"
                       for k, (_, line) in enumerate(FRAMES, 1)),
    "\nStackFrames", *(f"{k} {{file_location_id={k} parent_frame_id=1}}" for k in range(1, len(FRAMES) + 1))]) + "\n"


def test_the_sweep_names_the_tensor_core_instructions_of_each_kernel(tmp_path):
    """tests/gpu/aot.py --sweep reads the swept kernel's PTX: Hopper's wgmma with its operand types, or
    Ampere's mma.sync (what Pallas's FP8 kernels got before their dots allowed FP8 accumulation)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    from aot import mma_note

    def ptx(name, entry, *lines):
        path = tmp_path / name
        path.write_text("\n".join([".version 8.7", f".visible .entry {entry}(", ")", "{", *lines, "}"]))
        return str(path)

    other = ptx("a.ptx", "loop_fusion", "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1}, %rd1, %rd2;")
    hopper = ptx("b.ptx", "mlp_up", "\twgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%r1}, %rd1, %rd2, 0;",
                 "\twgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {%r1}, %rd1, %rd2, 1;")
    ampere = ptx("c.ptx", "attention_fwd", "\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%f1}, {%r1}, {%r2}, {%f2};")
    backward = ptx("d.ptx", "attention_dq", "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1};",
                   "}", ".visible .entry attention_dkv(", ")", "{",
                   "\twgmma.mma_async.sync.aligned.m64n64k32.f16.e4m3.e4m3 {%r1}, %rd1, %rd2;")  # two kernels
    assert mma_note("mlp_up", [other, hopper]) == ", wgmma (e4m3)"
    assert mma_note("attention_dq", [backward]).startswith(", mma.sync")  # not its neighbour's wgmma
    assert mma_note("attention_dkv", [backward]) == ", wgmma (e4m3)"  # the operands, not the f16 accumulator
    assert mma_note("attention_fwd", [other, hopper, ampere]) == ", mma.sync: Ampere's tensor-core path, not Hopper's wgmma"
    assert mma_note("mlp_up_2", [hopper]) == "" and mma_note("mlp_dpre", []) == ""


def test_head_ptx_counts_each_kernels_instructions_and_exponentials(tmp_path):
    """tests/gpu/aot.py --head-ptx: a kernel's PTX instructions, a predicated one once, neither directives,
    labels, braces nor comments; its ex2 among them; two kernels and a device function of one module apart."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    from aot import instruction_count, kernel_bodies

    path = tmp_path / "m.ptx"
    path.write_text("\n".join([
        ".version 8.7", ".target sm_90", "", "// .globl loop_convert_fusion",
        ".visible .entry loop_convert_fusion(", "\t.param .u64 loop_convert_fusion_param_0", ")", ".reqntid 128, 1, 1", "{",
        "\t.reg .b32 %r<9>;", "\tld.param.u64 %rd1, [loop_convert_fusion_param_0];  // the argument",
        "\tex2.approx.ftz.f32 %f2, %f1;", "\t@%p1 bra $L__BB0_2;", "$L__BB0_2:", "\tex2.approx.ftz.f32 %f3, %f2;",
        "\tret;", "", "}", ".func  (.param .b32 func_retval0) helper(", ")", "{", "\tmov.u32 %r1, 1;", "\tret;", "}",
        "\t// .globl input_reduce_fusion",
        ".visible .entry input_reduce_fusion(", ")", "{", "\tmov.u32 %r1, 0;", "\tret;", "}"]))
    bodies = kernel_bodies([str(path)])
    assert sorted(bodies) == ["input_reduce_fusion", "loop_convert_fusion"]  # the device function apart
    assert instruction_count(bodies["loop_convert_fusion"]) == (5, 2)  # ld, ex2, bra, ex2, ret
    assert instruction_count(bodies["input_reduce_fusion"]) == (2, 0)


def test_a_swept_kernels_registers_and_the_programs_they_leave_room_for(tmp_path, monkeypatch):
    """tests/gpu/aot.py --sweep: ptxas -v's registers of the kernel's module (here a stand-in ptxas), and
    how many of its programs fit a multiprocessor's 65,536 registers, a warp's taken in 8s a thread."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    import aot

    module = tmp_path / "m.ptx"
    module.write_text(".visible .entry attention_dq(\n)\n.reqntid 64, 1, 1\n{\n}\n"
                      ".visible .entry mlp_up(\n)\n.reqntid 256, 1, 1\n{\n\tret;\n}\n")
    ptxas = tmp_path / "ptxas"
    ptxas.write_text("#!/bin/sh\necho \"ptxas info    : Function properties for attention_dq\" >&2\n"
                     "echo \"ptxas info    : Used 40 registers, used 1 barriers\" >&2\n"
                     "echo \"ptxas info    : Function properties for mlp_up\" >&2\n"
                     "echo \"ptxas info    : Used $REGS registers, used 1 barriers\" >&2\n")
    ptxas.chmod(0o755)
    monkeypatch.setattr(aot, "ptxas_binary", lambda: str(ptxas))
    for regs, fit in ((236, 1), (128, 2), (121, 2), (129, 1), (108, 2), (64, 4)):  # 121 taken as 128, 129 as 136
        monkeypatch.setenv("REGS", str(regs))
        expected = f", {regs} registers a thread (registers for {fit} of its 256-thread programs a multiprocessor)"
        assert aot.registers_note("mlp_up", [str(module)]) == expected, regs
    assert aot.registers_note("mlp_dpre", [str(module)]) == ""  # no PTX of it
    monkeypatch.setattr(aot, "ptxas_binary", lambda: None)
    assert aot.registers_note("mlp_up", [str(module)]) == ""  # no ptxas here (CI)


def test_ptx_blocks_map_a_kernels_loop_and_its_branches():
    """tests/gpu/aot.py --ptx-blocks: each basic block's instructions in order, and at each branch those up to
    it and its target, so that a loop step's instructions on each path can be read off (here a loop step of
    4 + 3 instructions where its second branch is taken, 7 + 3 where not)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    from aot import block_map

    body = "\n".join([".visible .entry attention_fwd(", "{", "\tmov.u32 %r1, 0;", "\tbra.uni $L__BB0_1;",
                       "$L__BB0_4:", "\tadd.s32 %r1, %r1, 1;  // the step's common part", "\tex2.approx.f32 %f1, %f1;",
                       "\twgmma.commit_group.sync.aligned;", "$L__BB0_1:", "\tsetp.ge.s32 %p1, %r1, 9;",
                       "\t@%p1 bra $L__BB0_5;", "\tsetp.eq.s32 %p2, %r1, 4;", "\t@%p2 bra \t$L__BB0_4;",
                       "\tselp.f32 %f1, %f1, %f2, %p2;", "\tselp.f32 %f1, %f1, %f2, %p2;", "\tbra.uni $L__BB0_4;",
                       "$L__BB0_5:", "\tret;", "}"])
    assert block_map(body) == ("entry 2 (2 to $L__BB0_1) | $L__BB0_4 3 | $L__BB0_1 7 (2 to $L__BB0_5, 4 to $L__BB0_4, "
                               "7 to $L__BB0_4) | $L__BB0_5 1")


def test_traffic_estimate_takes_a_kernels_instructions_for_its_floor_where_they_outlast_its_bytes(tmp_path):
    """XLA's kernels' PTX instructions x their launch's threads (the thunk sequence's blocks x threads), times
    the loop's trips, at the H100's issue rate: a line's floor where longer than its bytes' ("issue-bound")."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    from aot import HBM_BYTES_PER_S, ISSUES_PER_S, thread_instructions, traffic, traffic_lines

    ptx = tmp_path / "m.ptx"
    ptx.write_text("\n".join([".visible .entry r(", ")", "{", *["\tadd.f32 %f1, %f1, %f1;"] * 9, "\tret;", "}",
                               ".visible .entry u(", ")", "{", "\tret;", "}", ".visible .entry d(", ")", "{", "\tret;", "}"]))
    sequence = tmp_path / "m.thunk_sequence.txt"
    sequence.write_text("000: kWhile [source | next=002 (1)]\n"
                        "    001: kCustomKernel   [prev=000 (1)   | sink          ] r grid: [1000, 2, 1] threads: [128, 1, 1]"
                        "  shared_memory: 0 bytes\n"
                        "002: kCustomKernel [prev=000 (1) | sink] u grid: [4, 1, 1] threads: [64, 1, 1]  shared_memory: 0 bytes\n"
                        "003: kCublasLtMatmul [source | sink] cublas-gemm.1\n")
    launches = thread_instructions([str(ptx)], [str(sequence)])
    assert launches == {"r": 10 * 2000 * 128, "u": 1 * 4 * 64}  # d: no launch in the sequence
    rows, _ = traffic(TRAFFIC_HLO, instructions=launches)
    assert rows["read_row:5 < step:20"][4] == 4 * (10 * 2000 * 128 + 4 * 64)  # both kernels, 4 trips
    assert rows["matmul:10 < step:20"][4] == 0  # no PTX of it
    lines = traffic_lines(TRAFFIC_HLO, 5, 1, launches)
    row = rows["read_row:5 < step:20"]
    assert row[4] / ISSUES_PER_S > row[0] / HBM_BYTES_PER_S
    assert lines[1].startswith(f"    {row[4] / ISSUES_PER_S * 1e3:7.1f} ms") and lines[1].endswith("issue-bound  read_row:5 < step:20")
    assert "without the instructions' floor" in lines[0] and "issue-bound" not in lines[2]
    assert "issue-bound" not in "".join(traffic_lines(TRAFFIC_HLO, 5, 1)) and "instructions' floor" not in \
        traffic_lines(TRAFFIC_HLO, 5, 1)[0]


def test_traffic_estimate_counts_the_bytes_collectives_send_apart_from_memory():
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    from aot import HBM_BYTES_PER_S, NVLINK_BYTES_PER_S, traffic, traffic_lines

    size, share = 1024 * 256 * 4, 128 * 256 * 2
    rows, unknown = traffic(COLLECTIVES_HLO, devices=8)
    # each start sends its part (all-reduce 2·7/8 of the operand, reduce-scatter to 8 shares 7/8 of it,
    # the all-gather in pairs its one share, in a conditional's branch); the dones are free; the update moves
    # three arrays in HBM, the other branch's stacking reads the share twice and writes it twice
    assert rows == {"psum:30": [0, 0, 1, 2 * 7 / 8 * size, 0], "scatter:40": [0, 0, 1, 7 / 8 * size, 0],
                    "gather:50": [0, 0, 1, share, 0], "step:20": [3 * size, 0, 1, 0, 0],
                    "pad:60": [4 * share, 0, 1, 0, 0]} and unknown == []
    # an even step's: no branch of the conditional
    assert traffic(COLLECTIVES_HLO, devices=8, branches=False)[0] == {
        k: v for k, v in rows.items() if k not in ("gather:50", "pad:60")}
    # groups the HLO names only by the mesh: all the devices
    meshed = COLLECTIVES_HLO.replace("replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups=mesh['dp'=2] {'dp'}")
    assert traffic(meshed, devices=2)[0]["psum:30"][3] == size  # 2·1/2
    lines = traffic_lines(COLLECTIVES_HLO, 5, 8)
    sent = (2 * 7 / 8 + 7 / 8) * size + share
    assert f"{sent / 1e9:.2f} GB sent to the other devices ({sent / NVLINK_BYTES_PER_S * 1e3:.1f} ms at an assumed" in lines[0]
    even_ms = (2 * 7 / 8 * size + 7 / 8 * size) / NVLINK_BYTES_PER_S * 1e3 + 3 * size / HBM_BYTES_PER_S * 1e3
    assert lines[1] == (f"    without conditionals' branches (an even step): {3 * size / 1e9:.0f} GB moved, "
                        f"{(sent - share) / 1e9:.2f} GB sent, sum of per-kernel floors {even_ms:.0f} ms")
    # the slowest first
    assert [l.split()[-1] for l in lines[2:]] == ["psum:30", "scatter:40", "step:20", "gather:50", "pad:60"]
    assert lines[2].endswith(f"{2 * 7 / 8 * size / 1e9:.2f} GB sent  psum:30") and "sent" not in lines[4]
    assert "sent" not in traffic_lines(TRAFFIC_HLO, 5, 1)[0]


# ---------------------------------------------------------------------------------------------
# (c) Attention at full length against a dense fp32 reference on sampled query blocks


if LANE:
    import train_gpt

    IMPLS = sorted(train_gpt.ATTENTION)
else:
    IMPLS = ["xla"]  # skipped: importing train_gpt is not worth it


# (window in tokens, heads, length factor): the record's windows of the last stage and the final
# validation on 6 heads; the paired layers' 3 heads over the doubled sequence at the short window
ATTENTION_CASES = [(640, 6, 1), (2560, 6, 1), (640, 3, 2)]


@lane
@pytest.mark.parametrize("window, heads, factor", ATTENTION_CASES)
@pytest.mark.parametrize("impl", IMPLS)
def test_attention_matches_dense_fp32_reference(impl, window, heads, factor):
    result = run_case("attention", impl, window, factor * ATTENTION_T, heads)
    print(result)
    assert result["out_err"] < OUT_TOL, result
    for g in ("dq", "dk", "dv"):
        assert result[f"{g}_err"] < GRAD_TOL, result
        assert result[f"{g}_max"] > 0, result  # the sampled rows reach every gradient


def case_attention(impl: str, window: int, T: int, H: int) -> dict:
    import train_gpt as tg

    K, B, scale = 128, tg.BLOCK, 0.1
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    N, reach = T // B, window // B + 2  # blocks a query may reach back, and one more
    # Query blocks: the first, the last, and two between whose rows see a document start inside
    # their own block (the document rule binds). The last block's document spans `reach` blocks
    # before it (the window rule binds: one key too many or too few changes its rows).
    middle = sorted(rng.choice(np.arange(1, N - reach - 1), 2, replace=False).tolist())
    blocks = [0, *middle, N - 1]
    rows = np.concatenate([np.arange(n * B, (n + 1) * B) for n in blocks])
    is_bos = np.zeros(T, bool)
    is_bos[rng.choice(T, max(2, T // 4000), replace=False)] = True  # documents of ~4,000 tokens
    is_bos[[n * B + int(rng.integers(1, B)) for n in middle]] = True
    is_bos[(N - 1 - reach) * B:] = False
    docs = jnp.asarray(np.cumsum(is_bos), jnp.int32)
    q, k, v = (jnp.asarray(rng.standard_normal((T, H, K)), jnp.bfloat16) for _ in range(3))
    cot = np.zeros((T, H, K), np.float32)
    cot[rows] = rng.standard_normal((len(rows), H, K))
    cot = jnp.asarray(cot, jnp.bfloat16)  # non-zero only on the sampled rows

    attend = tg.ATTENTION[impl]

    @partial(jax.jit, compiler_options=tg.COMPILER_OPTIONS)  # rounding as the train program does
    def run(q, k, v, cot, w, s):  # window and scale are traced values, as in the model
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, docs, w, s), q, k, v)
        return out, *vjp(cot)

    out, dq, dk, dv = run(q, k, v, cot, jnp.int32(window), jnp.float32(scale))
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape, (out.dtype, out.shape)

    rows_j = jnp.asarray(rows)

    def dense(q_rows, k, v):
        """The rule written out for the sampled query rows against all T keys, in fp32: keys at most
        `window` tokens back, same document."""
        j = jnp.arange(T)
        distance = rows_j[:, None] - j[None, :]
        allowed = (distance >= 0) & (distance <= window) & (docs[None, :] == docs[rows_j][:, None])
        s = jnp.einsum("rhd,khd->hrk", q_rows, k) * scale
        p = jax.nn.softmax(jnp.where(allowed[None], s, -jnp.inf), axis=-1)
        return jnp.einsum("hrk,khd->rhd", p, v)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    with jax.default_matmul_precision("highest"):  # a true fp32 reference, no TF32
        ref_out, ref_vjp = jax.vjp(dense, f32(q[rows_j]), f32(k), f32(v))
        ref_dq_rows, ref_dk, ref_dv = ref_vjp(f32(cot[rows_j]))
    ref_dq = jnp.zeros((T, H, K), jnp.float32).at[rows_j].set(ref_dq_rows)  # other rows get no gradient

    def rel_err(a, b):
        return float(jnp.max(jnp.abs(f32(a) - b)) / jnp.max(jnp.abs(b)))

    return {"impl": impl, "window": window, "T": T, "heads": H, "seed": seed, "query_blocks": blocks,
            "out_err": rel_err(out[rows_j], ref_out),
            "dq_err": rel_err(dq, ref_dq), "dk_err": rel_err(dk, ref_dk), "dv_err": rel_err(dv, ref_dv),
            "dq_max": float(jnp.max(jnp.abs(ref_dq))), "dk_max": float(jnp.max(jnp.abs(ref_dk))),
            "dv_max": float(jnp.max(jnp.abs(ref_dv)))}


@pytest.mark.skipif(not ON_GPU, reason=f"GPU lane: JAX backend is {BACKEND}, not gpu")
@pytest.mark.parametrize("head_dim", [128, 16])  # the record's, the cpu preset's
def test_rotary_frequencies_are_the_ones_torch_builds_on_the_gpu(head_dim):
    """The reference builds its rotary frequencies on the GPU, (1/1024)^linspace(0, 1) in float32: CUDA's
    linspace kernel and power may round otherwise than torch's CPU, whose values rope_freqs matches bit
    for bit at these sizes (tests/ref89_schedule.tsv; numpy's float32 linspace and power were up to 7
    ulps off: 1% of the bf16 rotary tables' entries at a last-stage chunk's positions). Where they
    differ, the GPU's are the record's. Needs torch with CUDA, which the GPU machines have (not a
    project package)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    import train_gpt as tg

    n = head_dim // 4
    theirs = ((1 / 1024) ** torch.linspace(0, 1, steps=n, dtype=torch.float32, device="cuda")).cpu().numpy()
    ours = tg.rope_freqs(head_dim)[:2 * n:2]
    ulps = np.abs(ours.view(np.int32).astype(np.int64) - theirs.view(np.int32))
    print(f"head_dim {head_dim}: ulps apart {ulps.tolist()}")
    assert ulps.max() == 0, {int(i): (float(ours[i]), float(theirs[i])) for i in np.nonzero(ulps)[0]}
    # the bf16 cos and sin tables over a last-stage chunk's positions (the paired layers' 2T): torch's
    # cos and sin of its fp32 angles on CUDA, ours from rotary() turning each lane pair (1, 0) into
    # (cos, -sin), rounded as it rounds them in a jitted program
    S = 2 * 49152
    freq = tg.rope_freqs(head_dim)
    theta = torch.outer(torch.arange(S, dtype=torch.float32, device="cuda"), torch.from_numpy(freq).cuda())
    want = np.stack([theta.cos().to(torch.bfloat16).float().cpu().numpy(),
                     -theta.sin().to(torch.bfloat16).float().cpu().numpy()])
    pairs = jnp.tile(jnp.array([1.0, 0.0], jnp.bfloat16), head_dim // 2).reshape(1, 1, head_dim)
    turned = jax.jit(lambda p: tg.rotary(jnp.broadcast_to(p, (S, 1, head_dim)), jnp.asarray(freq),
                                         jnp.arange(S, dtype=jnp.float32), False))(pairs)
    got = np.asarray(turned.astype(jnp.float32))[:, 0].reshape(S, head_dim // 2, 2)
    got = np.stack([np.repeat(got[..., 0], 2, -1), np.repeat(got[..., 1], 2, -1)])
    differ = float(np.mean(got != want))
    print(f"head_dim {head_dim}: bf16 cos/sin entries that differ from torch's on CUDA: {differ:.2e}")
    # two cos implementations an ulp apart round to different bf16 next to a midpoint: XLA's and torch's on
    # CPU, 4 of these 12.6M entries (2026-11-28); frequencies 1-7 ulps off made it 1.04%
    assert differ <= 1e-5, differ


@lane
def test_dc_kernels_match_the_xla_path():
    result = run_case("dc", ATTENTION_T)
    print(result)
    # on CPU both paths are within 16 units of 2^-8 of float64 with the reference's roundings, 3 in 98% of
    # draws (tests/test_attention.py), and apart by 2.7e-5 (out) and at most 5.6e-5 (gradients) in norm at
    # 4,096 tokens (this case, interpreted); a GPU's exp2 and exp differ by a few fp32 ulps more, which may flip a
    # bf16 rounding of c_h or ds here and there
    for name in ("out", "dy", "dq", "dk", "dv", "dw1", "dw2"):
        assert result[f"{name}_vs_xla"] <= 2.0**-9, result


def case_dc(T: int) -> dict:
    """add_dc_correction (layer 10's DC correction added to its attention output) with --dc pallas
    against the XLA path at T tokens, 6 heads of 128, documents of ~1,000 tokens: the output and the
    gradients of all six inputs, each as the norm of the difference over the XLA path's."""
    import train_gpt as tg

    H, K = 6, 128
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    docs = jnp.asarray(np.cumsum(rng.random(T) < 1 / 1000), jnp.int32)
    y, q, k, v, dout = (jnp.asarray(rng.standard_normal((T, H, K)), jnp.bfloat16) for _ in range(5))
    w1, w2 = (jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16) for _ in range(2))

    def run(impl):
        @partial(jax.jit, compiler_options=tg.COMPILER_OPTIONS)
        def f(y, q, k, v, w1, w2, dout):
            out, vjp = jax.vjp(lambda *x: tg.ADD_DC_CORRECTION[impl](*x[:4], docs, *x[4:], jnp.float32(0.12)),
                               y, q, k, v, w1, w2)
            return out, *vjp(dout)
        return [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in f(y, q, k, v, w1, w2, dout)]

    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    names = ["out", "dy", "dq", "dk", "dv", "dw1", "dw2"]
    return {"T": T, "seed": seed, **{f"{n}_vs_xla": rel(a, b) for n, a, b in zip(names, run("pallas"), run("xla"))}}


@lane
def test_mlp_kernels_match_float64_and_the_xla_path():
    result = run_case("mlp", ATTENTION_T)
    print(result)
    # in units of 2^-8 of a value, as in tests/test_model.py: relu(pre) may round to the other neighbour
    # (its fp32 sum differs from float64's), up to 2 units (a bf16 ulp is 2^-7 to 2^-8 of a value), which
    # the square doubles, then post's own rounding; dpre: c's other neighbour and its own rounding
    assert result["post_ulps"] <= 5 and result["dpre_ulps"] <= 3, result
    assert result["post_f8_exact"] and result["amax_exact"], result
    # against the XLA path: its FP8 GEMM accumulates in another order, so its post is as far from float64
    # (xla_post_ulps) but rounds to the other bf16 neighbour in places (2026-11-27, one H200: 5.1% of
    # post). There the e4m3 copy may take its other neighbour, an e4m3 step (2^-3 of a value), rarely:
    # out within 2^-5 in norm (0.0074 that day); amax, post's largest value, within its doubled pre
    # step and own rounding (2^-6 + 2^-8); the bf16 backward within a bf16 step (2^-7; 0.0034 that day)
    assert result["out_vs_xla"] <= 2.0**-5 and result["amax_vs_xla"] <= 2.0**-5, result
    for name in ("dx", "dw1", "dw2"):
        assert result[f"{name}_vs_xla"] <= 2.0**-7, result


def case_mlp(T: int) -> dict:
    """mlp_fp8 with --mlp pallas at the record's sizes (D 768, F 3072) and T tokens, a fifth of the rows
    padding: its kernels against float64 on the same e4m3/bf16 operands (256 sampled rows, in units of
    the bf16 rounding 2^-8), and the whole MLP forward and backward against the XLA path."""
    import train_gpt as tg

    D, F = 768, 3072
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    valid = jnp.asarray(rng.random(T) < 0.8)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    w1, w2 = (jnp.asarray(rng.uniform(-0.04, 0.04, (F, D)), jnp.bfloat16) for _ in range(2))
    g = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    w2_scale, act_scale = jnp.float32(0.04 * 1.12 / 448), jnp.float32(0.01)

    @partial(jax.jit, compiler_options=tg.COMPILER_OPTIONS)
    def kernels(x, w1, g):
        w1_f8, w1_scale = tg.quantize_up(w1)
        x_amax = jnp.max(jnp.where(valid[:, None], jnp.abs(x), 0)).astype(jnp.float32)
        x_f8 = jnp.clip(x.astype(jnp.float32) * (tg.E4M3_MAX / x_amax), -tg.E4M3_MAX, tg.E4M3_MAX).astype(tg.E4M3)
        dequant = w1_scale * x_amax / np.float32(tg.E4M3_MAX)
        post, post_f8, amax = tg.pallas_mlp_up(x_f8, w1_f8, dequant, act_scale, valid)
        want_f8 = jnp.minimum(post.astype(jnp.float32) * (1 / act_scale), tg.E4M3_MAX).astype(tg.E4M3)
        return x_f8, w1_f8, dequant, post, jnp.array_equal(post_f8, want_f8), amax, tg.pallas_mlp_dpre(g, w2, post)

    x_f8, w1_f8, dequant, post, f8_ok, amax, dpre = kernels(x, w1, g)
    rows = np.sort(rng.choice(T, 256, replace=False))
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    bf16 = lambda a: f64(jnp.asarray(a, jnp.bfloat16))  # noqa: E731
    post64 = np.maximum(bf16(f64(x_f8[rows]) @ f64(w1_f8).T * float(dequant)), 0) ** 2
    dpre64 = 2 * bf16(f64(g[rows]) @ f64(w2).T) * np.sqrt(f64(post[rows]))
    # in bf16 roundings of each value (2^-8 of it), with a floor of 2^-16 of the largest: fp32 sums that
    # cancel to near zero differ from float64 by more than a rounding of their tiny result
    ulps = lambda got, want: float(np.max(np.abs(got - want) / (2.0**-8 * np.abs(want) + 2.0**-16 * np.abs(want).max())))  # noqa: E731,E501

    def run(impl):
        def f(x, w1, w2):
            out, amax = tg.mlp_fp8(x, w1, w2, w2_scale, act_scale, valid, impl)
            return jnp.sum(out.astype(jnp.float32) * g.astype(jnp.float32)), (out, amax)
        (_, aux), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True),
                                  compiler_options=tg.COMPILER_OPTIONS)(x, w1, w2)
        return [f64(a) for a in (*aux, *grads)]

    names = ["out", "amax", "dx", "dw1", "dw2"]
    vs_xla = {f"{n}_vs_xla": float(np.linalg.norm(a - b) / np.linalg.norm(b))
              for n, a, b in zip(names, run("pallas"), run("xla"))}
    # the XLA path's post (its forward's residual) on the same rows: which path a difference comes from
    post_xla = jax.jit(lambda *a: tg._mlp_fp8_fwd(*a, w2_scale, act_scale, valid, "xla")[1][3],
                       compiler_options=tg.COMPILER_OPTIONS)(x, w1, w2)
    post_all = f64(post)
    return {"T": T, "seed": seed, "post_ulps": ulps(f64(post[rows]), post64),
            "xla_post_ulps": ulps(f64(post_xla[rows]), post64), "post_differ": float(jnp.mean(post != post_xla)),
            "dpre_ulps": ulps(f64(dpre[rows]), dpre64),
            "post_f8_exact": bool(f8_ok), "amax_exact": float(amax) == float(post_all[np.asarray(valid)].max()),
            **vs_xla}


@lane
def test_head_kernels_match_the_xla_path():
    result = run_case("head", ATTENTION_T)
    print(result)
    # the logits (one cuBLASLt GEMM for both paths) against the exact product of their e4m3 operands: the
    # bf16 rounding, plus what fast FP8 accumulation drops (2026-11-27, one H200: 2.95 bf16 steps at most)
    assert result["xla_acc_excess"] <= 1, result
    # the kernel's sigmoids against XLA's of the same logits: its exp is Hopper's ex2.approx, XLA's another
    # (a few fp32 ulps apart), so a sigmoid next to a bf16 midpoint rounds to the other neighbour, rarely
    assert result["sig_differ"] <= 1e-2 and result["sig_max_steps"] <= 1, result
    # each path's normaliser against float64's of its own sigmoids: fp32 sums and exps
    assert result["pallas_lse_vs_f64"] <= 5e-5 and result["xla_lse_vs_f64"] <= 5e-5, result
    # between the paths: a z whose sigmoid rounds apart moves by 23·2^-8, with either sign; z is nearly flat
    # (softmax weights near 1/V): 5 sd if every z flipped
    lse_bound = 5 * 23 * 2.0**-8 / np.sqrt(50304)
    assert result["lse_max_diff"] <= lse_bound, result
    # a target's z, so its loss, moves by one such step at most, times the target's weight (2026-11-27,
    # H100: a per-token loss 0.0899 apart, one weight-1 target); the normaliser's difference beside it
    assert result["loss_max_diff"] <= result["weight_max"] * (23 * 2.0**-8 + lse_bound), result
    assert result["loss_mean_diff"] <= 1e-3, result
    for name in ("dx", "dw"):  # e5m2 gradients: a sigmoid or an exp rounding the other way may flip one, rarely
        assert result[f"{name}_vs_xla"] <= 1e-2, result


def case_head(T: int) -> dict:
    """train_head_loss with --head pallas against --head xla at T tokens of the record's head (768 x 50,304,
    the lm_head's initial scale), 3 MTP weights and a prefix weight: per-token losses and both gradients."""
    import train_gpt as tg

    D, V = 768, 50304
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(0, 0.005, (D, V)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 50257, T), jnp.int32)
    prefix = jnp.asarray(np.where(rng.random(T) < 0.5, rng.integers(0, 50257, T), -1), jnp.int32)
    cols, ws, total = tg._loss_targets(targets, jnp.asarray([1.0, 0.5, 0.25], jnp.float32), prefix,
                                       jnp.float32(0.25), V)

    def run(impl):
        f = jax.jit(jax.value_and_grad(lambda x, w: tg.train_head_loss(x, w, cols, ws, total, impl), argnums=(0, 1),
                                       has_aux=True), compiler_options=tg.COMPILER_OPTIONS)
        (_, losses), (dx, dw) = f(x, w)
        return [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (losses, dx, dw)]

    (lp, dxp, dwp), (lx, dxx, dwx) = run("pallas"), run("xla")

    rows = np.sort(rng.choice(T, 64, replace=False))

    @partial(jax.jit, compiler_options=tg.COMPILER_OPTIONS)
    def softcap(x, w):  # both implementations' sigmoids and normaliser, as _train_head_fwd computes them;
        # compared on the device (T x 50,304 logits: 20 GB each in float64)
        x_f8 = (x.astype(jnp.float32) / np.float32(tg.LM_HEAD_X_S)).astype(tg.E4M3)
        w_f8 = (w.astype(jnp.float32) / np.float32(tg.LM_HEAD_W_S)).astype(tg.E4M3)
        u_x = tg._fp8_logits(x_f8, w_f8)  # cuBLASLt's bf16 logits (the FP8 check: no fp32 ones in between)
        sig_p, lse_p = tg.pallas_head_softcap(u_x)
        sig_x = tg._softcap_sig(u_x)
        lse_x = tg._capped_lse(np.float32(tg.SOFTCAP_A) * sig_x)
        sig_p = sig_p.astype(jnp.float32)
        power = jax.lax.bitcast_convert_type(  # 2^exponent of each sigmoid: bf16's step there is 2^-7 of it
            jax.lax.bitcast_convert_type(sig_x, jnp.uint32) & np.uint32(0x7F800000), jnp.float32)
        steps = jnp.abs(sig_p - sig_x) / (power * np.float32(2.0**-7))
        return (jnp.mean(sig_p != sig_x), jnp.max(steps), jnp.max(jnp.abs(lse_p - lse_x)), x_f8[rows], w_f8,
                u_x[rows], sig_p[rows], lse_p[rows], lse_x[rows])

    sig_differ, sig_max_steps, lse_max_diff, x_f8, w_f8, u_x, sig_p, lse_p, lse_x = softcap(x, w)
    # the logits on 64 rows against the exact (float64) product of the same e4m3 operands, in bf16 steps
    # (with a floor of 2^-13, the step at 2^-6; logits are about 0.14: a sum of 768 products cancelling
    # to near zero is off by more than a step of its tiny result): 0.5 is correct rounding; more is the
    # GEMM's FP8 accumulation
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    x64, w64, u_scale = f64(x_f8), f64(w_f8), float(tg.LM_HEAD_U_S)
    exact = x64 @ w64 * u_scale
    step = lambda a: 2.0 ** np.floor(np.log2(np.maximum(np.abs(a), 2.0**-6))) * 2.0**-7  # noqa: E731
    # FP8 tensor-core accumulation keeps about 14 significant bits (DeepSeek-V3 report, section 3.3.2):
    # each of the D/32 additions of a 32-deep MMA into the running sum may drop 2^-13 of it, at most
    # sum_k |x_k w_k|; the excess over the rounding, as a fraction of that allowance (1: all of it)
    allowance = (D // 32) * 2.0**-13 * (np.abs(x64) @ np.abs(w64)) * u_scale
    u = f64(u_x)
    report = {"xla_ulps_f64": float(np.max(np.abs(u - exact) / step(exact))),
              "xla_acc_excess": float(np.max((np.abs(u - exact) - 0.5 * step(np.maximum(np.abs(u), np.abs(exact))))
                                             / allowance))}
    # each path's normaliser against float64's of its own sigmoids: z = A·bf16(sigmoid((u + B)/C))
    sig_x = f64(jnp.asarray((1 / (1 + np.exp(-(u + tg.SOFTCAP_B) / tg.SOFTCAP_C))).astype(np.float32), jnp.bfloat16))
    for name, sig, lse in (("pallas", f64(sig_p), lse_p), ("xla", sig_x, lse_x)):
        z = tg.SOFTCAP_A * sig
        top = z.max(axis=1, keepdims=True)
        lse64 = top[:, 0] + np.log(np.sum(np.exp(z - top), axis=1))
        report[f"{name}_lse_vs_f64"] = float(np.max(np.abs(f64(lse) - lse64)))
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    return {"T": T, "seed": seed, "sig_differ": float(sig_differ), "sig_max_steps": float(sig_max_steps), **report,
            "lse_max_diff": float(lse_max_diff),
            "loss_max_diff": float(np.max(np.abs(lp - lx))),
            "loss_mean_diff": float(np.mean(np.abs(lp - lx))), "weight_max": float(np.max(np.sum(np.asarray(ws), axis=1))),
            "loss_mean": float(lx.mean()), "dx_vs_xla": rel(dxp, dxx), "dw_vs_xla": rel(dwp, dwx)}


# ---------------------------------------------------------------------------------------------
# The session script (tests/gpu/session.sh): pieces under timeouts, output kept in $OUT


@pytest.mark.skipif(ON_GPU, reason="on a GPU the lane piece is the real lane, minutes long")
def test_session_script_keeps_each_pieces_output_and_refuses_unknown_pieces(tmp_path):
    script, out = os.path.join(ROOT, "tests", "gpu", "session.sh"), tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_LANE_ON_CPU": "0", "GPU_LANE_WORKERS": "2"}
    r = subprocess.run([script, "lane", "nope"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "unknown piece 'nope'" in r.stderr
    assert list(out.iterdir()) == []  # nothing ran
    r = subprocess.run([script, "--help"], capture_output=True, text=True, env={**env, "OUT": str(tmp_path / "h")},
                       timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("The GPU session's measurements") and "\nPieces:\n" in r.stdout
    assert not (tmp_path / "h").exists()  # usage only: no output folder

    # files of someone else's, named as the pieces' output, and an earlier pack in $OUT stay as they are
    (out / "rec").mkdir()
    theirs = {"lane.log": "mine", "sweep.txt": "mine", "rec/old.txt": "mine",
              "pieces_19700101_000000.tar.gz": "an earlier session's"}
    for name, text in theirs.items():
        (out / name).write_text(text)
    r = subprocess.run([script, "lane"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr  # without a GPU the lane's cases skip
    summary = (out / "session.txt").read_text()
    assert "== lane: exit 0" in summary
    assert {name: (out / name).read_text() for name in theirs} == theirs
    packs = [p for p in out.glob("pieces_*.tar.gz") if p.name not in theirs]  # this call's, one new file
    assert len(packs) == 1 and packs[0].name in summary
    assert sorted(p.name for p in out.iterdir()) == sorted(["lane.log", "sweep.txt", "rec", "session.txt",
                                                             "pieces_19700101_000000.tar.gz", packs[0].name])
    with tarfile.open(packs[0]) as tar:
        assert sorted(n for n in tar.getnames() if n != ".") == ["./lane.log"]
        lane = tar.extractfile("./lane.log").read().decode()
    # every case, in 2 worker processes (pytest -n), the session script's own test left out
    assert "2 workers" in lane and "SKIPPED" in lane and "test_train_through_every_stage" in lane
    assert "session_script" not in lane

    # under 45 s of the budget left (after the 25 s kept back): the piece is skipped, and said so
    r = subprocess.run([script, "lane"], capture_output=True, text=True, env={**env, "BUDGET_S": "60"}, timeout=60)
    assert r.returncode == 1 and re.search(r"== lane: skipped, 3[45]s of BUDGET_S=60 left", r.stdout), r.stdout
    for bad_env, bad_args, says in (({"BUDGET_S": "9m"}, ["lane"], "BUDGET_S=9m: give whole seconds"),
                                    ({}, ["lane short-xla"], "unknown piece 'lane short-xla'")):
        r = subprocess.run([script, *bad_args], capture_output=True, text=True, env={**env, **bad_env}, timeout=60)
        assert r.returncode == 2 and says in r.stderr, r.stderr

    # short-IMPL compiles into an empty cache of this call's for IMPL, from which profile-IMPL loads its
    # program; the caches go at the end. crash-IMPL compiles cold (into IMPL's cache while it is empty,
    # else a fresh one), XLA dumping its programs and the driver writing a core dump where fault.py
    # looks. (A stand-in python3 writes down its arguments and environment, and a file into the cache.)
    calls, stand_in = tmp_path / "calls.jsonl", tmp_path / "python3"
    stand_in.write_text(f"""#!{sys.executable}
import json, os, sys
with open({str(calls)!r}, "a") as f:
    f.write(json.dumps([sys.argv[1:], dict(os.environ)]) + "\\n")
if sys.argv[1] == "train_gpt.py":
    cache = sys.argv[sys.argv.index("--compile-cache-dir") + 1]
    os.makedirs(cache, exist_ok=True)
    open(os.path.join(cache, "program"), "w").close()
    rec = sys.argv[sys.argv.index("--records-dir") + 1]
    os.makedirs(rec, exist_ok=True)
    open(os.path.join(rec, f"run{{len(os.listdir(rec))}}.txt"), "w").close()
""")
    stand_in.chmod(0o755)
    r = subprocess.run([script, "short-xla", "profile-xla", "crash-pallas", "profile-pallas", "crash-xla", "bench"],
                       capture_output=True, text=True, env={**env, "PYTHON": str(stand_in), "XLA_FLAGS": "--mine"},
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    argv, envs = zip(*(json.loads(line) for line in calls.read_text().splitlines()))
    # after a run, records/logs.py reads its log (the newest) into the summary
    assert [a[0] for a in argv] == ["data/synthetic.py", "train_gpt.py", "records/logs.py", "bench.py", "train_gpt.py",
                                    "records/logs.py", "tests/gpu/fault.py", "bench.py", "train_gpt.py",
                                    "records/logs.py", "tests/gpu/fault.py", "bench.py"]
    assert [os.path.basename(a[1]) for a in argv if a[0] == "records/logs.py"] == ["run0.txt", "run1.txt", "run2.txt"]
    argv, envs = zip(*[(a, e) for a, e in zip(argv, envs) if a[0] != "records/logs.py"])
    assert argv[1][argv[1].index("--train-files") + 1].endswith("/synthetic_train_*.bin")  # the pattern, unexpanded
    cache = [a[a.index("--compile-cache-dir") + 1] for a in argv if "--compile-cache-dir" in a]
    short_xla, profile_xla, crash_pallas, profile_pallas, crash_xla, bench = cache
    assert short_xla == profile_xla != crash_pallas == profile_pallas == bench  # the suite loads pallas's programs
    assert "--suite" in argv[-1] and argv[-1][argv[-1].index("--attention") + 1] == "pallas"
    assert crash_xla not in (short_xla, crash_pallas)  # xla's cache held short-xla's program: a fresh one
    assert {os.path.dirname(c) for c in cache} == {os.path.dirname(short_xla)}
    assert not os.path.exists(os.path.dirname(short_xla))  # removed at the end
    crash, crash_env, (dump,) = argv[6], envs[6], argv[7][1:]
    assert [a for a in crash if a not in cache] == [a for a in argv[1] if a not in cache]  # the short run
    assert "CUDA_COREDUMP_FILE" not in envs[1] and "--xla_dump_to" not in envs[1]["XLA_FLAGS"]
    assert crash_env["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1"
    assert crash_env["CUDA_COREDUMP_FILE"] == f"{dump}/core.%p"
    assert crash_env["CUDA_ENABLE_CPU_COREDUMP_ON_EXCEPTION"] == "0"  # no host core of the process's tens of GB
    assert crash_env["XLA_FLAGS"] == f"--mine --xla_dump_to={dump}/xla --xla_dump_hlo_as_text"

    # with GPU_SESSION_CACHES the caches are that folder's, kept for a later run, which finds them there
    calls.unlink()
    kept = tmp_path / "kept" / "caches"
    for pieces in (["short-pallas"], ["profile-pallas"]):
        r = subprocess.run([script, *pieces], capture_output=True, text=True, timeout=60,
                           env={**env, "PYTHON": str(stand_in), "GPU_SESSION_CACHES": str(kept)})
        assert r.returncode == 0, r.stdout + r.stderr
    argv = [json.loads(line)[0] for line in calls.read_text().splitlines()]
    assert [a[0] for a in argv] == ["data/synthetic.py", "train_gpt.py", "records/logs.py", "bench.py"]
    caches = [a[a.index("--compile-cache-dir") + 1] for a in argv if "--compile-cache-dir" in a]
    assert caches == [str(kept / "pallas")] * 2
    assert (kept / "pallas" / "program").exists()

    # the lane: its cases side by side, each under a limit that ends before the piece's (the budget's)
    calls.unlink()
    r = subprocess.run([script, "lane"], capture_output=True, text=True, timeout=60,
                       env={**env, "PYTHON": str(stand_in), "BUDGET_S": "200", "GPU_LANE_WORKERS": "3"})
    assert r.returncode == 0, r.stdout + r.stderr
    ((lane_argv, lane_env),) = (json.loads(line) for line in calls.read_text().splitlines())
    assert lane_argv[:2] == ["-m", "pytest"] and lane_argv[lane_argv.index("-n") + 1] == "3"
    assert lane_env["FAILURES_AT_ONCE"] == "1" and 100 <= int(lane_env["GPU_LANE_TIMEOUT"]) <= 200 - 25 - 30
    assert lane_env["GPU_LANE_RESULTS"].endswith("/lane-results.jsonl")  # in the piece's output, packed

    # ncu: bench.py's sweep of the kernels' defaults under Nsight Compute, then its report's details as text
    calls.unlink()
    with open(stand_in, "a") as f:  # as ncu: the report where --export names it
        f.write('if "--export" in sys.argv:\n    open(sys.argv[sys.argv.index("--export") + 1] + ".ncu-rep", "w").close()\n')
    r = subprocess.run([script, "ncu"], capture_output=True, text=True, timeout=60,
                       env={**env, "PYTHON": str(stand_in), "NCU": str(stand_in), "XLA_FLAGS": "--mine"})
    assert r.returncode == 0, r.stdout + r.stderr
    (profiled, profiled_env), (page, _) = (json.loads(line) for line in calls.read_text().splitlines())
    app = profiled.index(str(stand_in))  # ncu's options, then the profiled command
    assert profiled[app + 1:app + 4] == ["bench.py", "--sweep", session_ncu_sweep()]
    assert " ".join(profiled[:2]) == "--clock-control none" and "regex:^(attention_|mlp_|dc_)" in profiled[:app]
    assert profiled_env["XLA_FLAGS"] == "--mine --xla_gpu_enable_command_buffer="
    assert page[:2] == ["--import", profiled[profiled.index("--export") + 1] + ".ncu-rep"] and "ncu-page" in r.stdout


def session_ncu_sweep() -> str:
    """The ncu piece's kernels: each Pallas kernel at train_gpt's default tuning (dq's sweep item runs the
    dk/dv kernel at its default beside it)."""
    import train_gpt as tg
    from bench import tuning_name
    return ",".join(tuning_name(k, t) for k, t in (("fwd", tg.PALLAS_FWD), ("dq", tg.PALLAS_DQ),
                                                   ("up", tg.PALLAS_MLP_UP), ("dpre", tg.PALLAS_MLP_DPRE),
                                                   ("dc", tg.PALLAS_DC)))


def test_the_ncu_piece_profiles_the_kernels_default_tunings():
    script = open(os.path.join(ROOT, "tests", "gpu", "session.sh")).read()
    assert f"NCU_SWEEP=${{NCU_SWEEP:-{session_ncu_sweep()}}}" in script


def test_a_case_result_is_kept_in_gpu_lane_results_as_it_ends(tmp_path, monkeypatch):
    kept = tmp_path / "results.jsonl"
    monkeypatch.setenv("GPU_LANE_RESULTS", str(kept))
    child = tmp_path / "child.py"  # stands in for this file as the child: prints a RESULT line
    child.write_text('import json, sys\nprint("noise")\nprint("RESULT " + json.dumps({"args": sys.argv[1:]}))\n')
    monkeypatch.setattr(sys.modules[__name__], "__file__", str(child))
    assert run_case("mlp", 512) == {"args": ["mlp", "512"]}
    assert run_case("head", 64) == {"args": ["head", "64"]}
    lines = [json.loads(line) for line in kept.read_text().splitlines()]
    assert lines == [{"case": ["mlp", "512"], "result": {"args": ["mlp", "512"]}},
                     {"case": ["head", "64"], "result": {"args": ["head", "64"]}}]


# A program as XLA dumps it after optimization (--xla_dump_hlo_as_text), cut down: a fusion whose kernel
# input_reduce_fusion_56 is named after it, the computation it calls, and the entry's parameters.
DUMPED_PROGRAM = """HloModule jit_train_step, entry_computation_layout={(s32[8,32768]{1,0})->f32[]}

%fused_reduce.57 (param_0.1: f32[32768,768], param_1.2: bf16[32768,768]) -> f32[32768] {
  %param_0.1 = f32[32768,768]{1,0} parameter(0)
  %param_1.2 = bf16[32768,768]{1,0} parameter(1)
  ROOT %reduce_sum.3 = f32[32768]{0} reduce(%mul.4, %constant_5), dimensions={1}, to_apply=%region_4.12
}

ENTRY %main.498 (inputs.1: s32[8,32768]) -> f32[] {
  %input_reduce_fusion.56 = f32[32768]{0} fusion(%gte.1, %gemm.2), kind=kInput, calls=%fused_reduce.57, \
metadata={op_name="jit(train_step)/while/body/reduce_sum" stack_frame_id=313}
  ROOT %loop_fusion.6 = f32[] fusion(%input_reduce_fusion.56), kind=kLoop, calls=%fused_computation.6
}
"""
GDB_SAYS = """Opening GPU coredump: CORE
CUDA Exception: Warp Illegal Instruction
The exception was triggered at PC 0x7f36c09b68b0
[Current focus set to CUDA kernel 0, grid 1532, block (8,0,0), thread (32,0,0), device 0, sm 0, warp 2, lane 0]
#0  0x00007f36c09b6970 in input_reduce_fusion_56<<<(16384,1,1),(128,1,1)>>> ()
#0  0x00007f36c09b6970 in sm90_xmma_gemm_e4m3bf16<<<(132,1,1),(384,1,1)>>> ()
"""


def test_the_fault_report_names_the_kernel_and_the_fusion_xla_compiled_into_it(tmp_path):
    """tests/gpu/fault.py with a stand-in cuda-gdb: the kernel its reading of the core dump names, that
    kernel's instruction in the dumped program (the fusion's '.' a '_' in the kernel's name), the
    computation it calls and the program's parameters; a library kernel found in no program is said so."""
    fault = os.path.join(ROOT, "tests", "gpu", "fault.py")
    r = subprocess.run([sys.executable, fault, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "no CUDA core dump in" in r.stdout, r.stdout + r.stderr
    (tmp_path / "xla").mkdir()
    (tmp_path / "xla" / "module_0042.jit_train_step.sm_9.0_gpu_after_optimizations.txt").write_text(DUMPED_PROGRAM)
    (tmp_path / "core.123").write_text("")
    if not os.path.exists("/usr/local/cuda/bin/cuda-gdb"):  # no cuda-gdb at all: said, exit 1
        r = subprocess.run([sys.executable, fault, str(tmp_path)], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PATH": "/usr/bin:/bin"})
        assert r.returncode == 1 and "cuda-gdb could not read" in r.stdout, r.stdout + r.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cuda-gdb").write_text(f"#!/bin/sh\ncat <<'EOF'\n{GDB_SAYS}EOF\n")
    (bin_dir / "cuda-gdb").chmod(0o755)
    r = subprocess.run([sys.executable, fault, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Warp Illegal Instruction" in r.stdout and "1 optimized programs dumped" in r.stdout
    found = r.stdout.split("-- input_reduce_fusion_56 in module_0042.jit_train_step")[1]
    assert "program: ENTRY %main.498 (inputs.1: s32[8,32768])" in found
    assert "%input_reduce_fusion.56 = f32[32768]{0} fusion(" in found and "stack_frame_id=313" in found
    assert "ROOT %reduce_sum.3 = f32[32768]{0} reduce(" in found and "%loop_fusion.6" not in found
    assert "-- sm90_xmma_gemm_e4m3bf16: no instruction of that name in the dumped programs" in r.stdout


def cuda_plugin_installed() -> bool:
    try:
        import jax_plugins
    except ImportError:
        return False
    return any(name.startswith("xla_cuda") for _, name, _ in pkgutil.iter_modules(jax_plugins.__path__))


@pytest.mark.skipif(cuda_plugin_installed(), reason="with JAX's CUDA plugin the script compiles for minutes")
def test_compile_only_script_says_how_to_install_the_cuda_plugin_it_needs():
    """tests/gpu/aot.py (compile for an H100 without one) in an environment without the plugin."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "aot.py"), "--programs", "last"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert 'pip install -r requirements.txt "jax[cuda13]==0.11.2"' in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------

CASES = {"train": (case_train, (str, int, str)), "hlo": (case_hlo, (str, int, str, str)),
         "attention": (case_attention, (str, int, int, int)), "mlp": (case_mlp, (int,)),
         "head": (case_head, (int,)), "dc": (case_dc, (int,))}

if __name__ == "__main__":
    name, *values = sys.argv[1:]
    fn, types = CASES[name]
    if len(values) != len(types):
        sys.exit(f"usage: python tests/test_gpu.py {name} " + " ".join(t.__name__.upper() for t in types))
    print(f"case {name} {' '.join(values)} on {jax.devices()[0].device_kind} ({BACKEND})", flush=True)
    print("RESULT " + json.dumps(fn(*(t(v) for t, v in zip(types, values)))), flush=True)
