"""Gradients of the port against the PyTorch record-89 reference (ref89.py), outside the suite.

    python tests/ref89_compare_grads.py --ref89 PATH/ref89.py --torch-python PATH/python \
        --weights W.npz --tokens T.npy --steps 1,423,847,1271 [--workdir DIR] [--jitter-rel 2e-3] [--jitter-seed 0] [--eager-rounding]

For each step: ref89 `grads` on W (G), ref89 `jitter` of W then `grads` on it (GJ: the reference's
own noise under half-a-bf16-step changes), and the port's gradients (P). Per parameter (banks per
matrix, padding skipped; lm_head and embed apart) it prints 1 - cosine and the norm ratio of P vs G
and of GJ vs G, whether P's exact zeros are G's, and a verdict: P's distance at most twice the
noise's. --eager-rounding: the port with ref89's eager rounding of the residual stream and of its
embedding rows' gradient sums (see EAGER). Every comparison script runs ref89 with the record's key
offset as the compiled record computes it (ref89_as_compiled).
ref89 runs under `flock /tmp/ref89.lock` (each side needs 10-15 GB); outputs are deleted.
"""
import argparse
import atexit
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_gpt as port  # noqa: E402

# --eager-rounding: ref89 runs torch eagerly, which rounds each term of a residual update
# `a*x + b*y + c*z` to bf16 and then each partial sum; the compiled record (and the port) round the
# fused sum once. Small terms (the x0 and bigram injections, MUDD mixes) are mostly rounded away
# eagerly, and the stream grows less: ~1% by the last layer. These replacements give the port the
# eager rounding, in a temporary copy (the patterns must match the port's code).
EAGER = [
    ("x = (f32(resid[i, 0]) * f32(x) + f32(post[i, 0]) * f32(y) + f32(x0) * f32(x0_gate[i])).astype(BF16)",
     "x = _b(_b(_b(f32(resid[i, 0]) * f32(x)) + _b(f32(post[i, 0]) * f32(y))) + _b(f32(x0) * f32(x0_gate[i])))"),
    ("x = (f32(resid[i, 1]) * f32(x) + f32(post[i, 1]) * f32(h)).astype(BF16)",
     "x = _b(_b(f32(resid[i, 1]) * f32(x)) + _b(f32(post[i, 1]) * f32(h)))"),
    ("return (f32(x_TxD) + f32(x0_bigram) * f32(coef_Tx1)).astype(BF16)",
     "return _b(f32(x_TxD) + _b(f32(x0_bigram) * f32(coef_Tx1)))"),
    ("x = ((1 + m[5]) * x32 + m[3] * c0 + m[4] * c7).astype(BF16)",
     "x = _b(_b(_b(_b(1 + m[5]) * x32) + _b(m[3] * c0)) + _b(m[4] * c7))"),
    ("x = (m[8] * f32(x) + m[9] * f32(y) + m[10] * f32(cache[0])).astype(BF16)",
     "x = _b(_b(_b(m[8] * f32(x)) + _b(m[9] * f32(y))) + _b(m[10] * f32(cache[0])))"),
    ("x = (m[12] * f32(x) + m[13] * f32(h)).astype(BF16)", "x = _b(_b(m[12] * f32(x)) + _b(m[13] * f32(h)))"),
    ("x = (f32(x) + m[0] * f32(cache[0]) + m[1] * f32(cache[7]) + m[2] * f32(cache[9]) + m[3] * f32(ve[0])\n"
     "         + m[4] * f32(cache[3])).astype(BF16)",
     "x = _b(_b(_b(_b(_b(f32(x) + _b(m[0] * f32(cache[0]))) + _b(m[1] * f32(cache[7]))) + _b(m[2] * f32(cache[9])))\n"
     "           + _b(m[3] * f32(ve[0]))) + _b(m[4] * f32(cache[3])))"),
    # eager torch on CPU sums nn.Embedding rows' cotangents in bf16 (compiled, and on GPUs: fp32), in the
    # check API's forward and in the train step's (train_steps), which adds the rows itself
    (": embedding(p[name], ids)", ": _index(p[name], ids)"),
    ("sums[name].at[i].add(g_rows[name].astype(F32))",
     "sums[name] + jnp.zeros(sums[name].shape, g_rows[name].dtype).at[i].add(g_rows[name]).astype(F32)"),
]


def load_port(eager: bool, workdir: str):
    """The port's module; with eager=True a copy whose residual updates round as eager torch does."""
    if not eager:
        return port
    # XLA may keep bf16 values in fp32 between ops (excess precision), which would skip these roundings;
    # set before the first computation, when the backend reads XLA_FLAGS
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
    src = open(os.path.join(ROOT, "train_gpt.py")).read()
    for compiled, eager_form in EAGER:
        assert compiled in src, f"--eager-rounding: the port no longer has {compiled!r}; update EAGER"
        src = src.replace(compiled, eager_form)
    src = src.replace("def gpt_hidden(", "def _b(v):\n    return v.astype(BF16)\n\n\ndef _index(table, ids):\n"
                      "    return table[ids]\n\n\ndef gpt_hidden(", 1)
    folder = tempfile.mkdtemp(dir=workdir)
    os.makedirs(os.path.join(folder, "data"))
    shutil.copy(os.path.join(ROOT, "data", "gpt2.tiktoken"), os.path.join(folder, "data"))
    path = os.path.join(folder, "train_gpt.py")  # next to data/gpt2.tiktoken, as in the repository
    open(path, "w").write(src)
    import importlib.util
    spec = importlib.util.spec_from_file_location("port_eager", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    atexit.register(shutil.rmtree, folder, True)  # the prefix table is read from it later
    return module

def pieces(name, g, hp):
    """(label, array) pieces compared on their own: banks per matrix (padding skipped), else whole."""
    if name == "qk_bank":
        return [(f"qk[{i}]", g[i]) for i in range(port.num_qk_matrices())]
    if name == "vo_bank":
        return [(f"vo[{i}]", g[i]) for i in range(2 * len(port.ATTN_LAYERS))]
    if name == "mlp_bank":
        return [(f"mlp[{i},{j}]", g[i, j]) for i in range(port.NUM_LAYERS) for j in range(2)]
    return [(name, g)]


def distance(a, b):
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 or nb == 0:
        return (0.0 if na == nb else 1.0), (1.0 if na == nb else np.inf)
    return 1 - a @ b / (na * nb), na / nb


# The record's key offset, `k[:, 1:, :, 64:] = k[:, :-1, :, 64:]`, copies a tensor into an overlapping
# view of itself. Compiled, as the record runs it, that is a shift (torch.compile reads the source before
# it writes; checked with torch 2.13's inductor). ref89 runs it eagerly on a CPU, where the copy runs in
# place, split over threads: it smears earlier positions' keys forward, differently from run to run,
# while autograd's backward treats it as a shift. So the comparisons run a copy of ref89.py with one more
# source patch, `.clone()` on the right-hand side: the compiled record's shift, deterministic.
KEY_OFFSET = "k[:, 1:, :, self.head_dim // 2:] = k[:, :-1, :, self.head_dim // 2:]"
REF89_PATCHES = '    body = body.replace("pin_memory=True", "pin_memory=False")\n'  # where ref89 patches the source


def ref89_as_compiled(path: str, workdir: str) -> str:
    """The path of a copy of ref89.py, WORKDIR/ref89_as_compiled/ref89.py (kept, with the files beside
    the original), that also patches the key offset's overlapping copy into the compiled record's shift
    (see KEY_OFFSET). Print it for ref89 commands of your own (making W1):
        python -c "import sys; sys.path.insert(0, 'tests'); import ref89_compare_grads as c; print(c.ref89_as_compiled('PATH/ref89.py', '/tmp'))"
    """
    src = open(path).read()
    assert REF89_PATCHES in src, f"{path} no longer patches the source at {REF89_PATCHES!r}; update ref89_as_compiled"
    patch = f"    body = _replace(body, {KEY_OFFSET!r}, {KEY_OFFSET + '.clone()'!r})\n"
    folder = os.path.join(workdir, "ref89_as_compiled")
    os.makedirs(folder, exist_ok=True)
    here = os.path.dirname(os.path.abspath(path))
    for name in os.listdir(here):  # gpt2.tiktoken, selfcheck.py
        if name != os.path.basename(path) and os.path.isfile(os.path.join(here, name)):
            shutil.copyfile(os.path.join(here, name), os.path.join(folder, name))  # not its read-only mode
    copy = os.path.join(folder, os.path.basename(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as f:  # another script may be reading it
        f.write(src.replace(REF89_PATCHES, REF89_PATCHES + patch))
    os.replace(f.name, copy)
    return copy


LOCK = "/tmp/ref89.lock"  # one 10-15 GB side at a time, ref89's or ours, whoever else shares the machine


def run(cmd):
    subprocess.run(["flock", LOCK, *cmd], check=True, stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def locked():
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def parser(doc: str, tokens_help: str = "a flat token array (.npy)") -> argparse.ArgumentParser:
    """The options every ref89 comparison takes: the reference, its Python, weights, tokens, scratch folder."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref89", required=True, help="ref89.py")
    ap.add_argument("--torch-python", required=True, help="a Python with torch for it")
    ap.add_argument("--weights", required=True, help="an npz as ref89.py init writes it")
    ap.add_argument("--tokens", required=True, help=tokens_help)
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="scratch files (deleted once compared)")
    return ap


def main():
    ap = parser(__doc__)
    ap.add_argument("--steps", default="1,423,847,1271")
    ap.add_argument("--jitter-rel", type=float, default=2e-3)
    ap.add_argument("--jitter-seed", type=int, default=0, help="another sample of the reference's noise")
    ap.add_argument("--verbose", action="store_true", help="print every piece, not only the summary per parameter")
    ap.add_argument("--eager-rounding", action="store_true", help="the port with ref89's eager residual rounding")
    a = ap.parse_args()
    a.ref89 = ref89_as_compiled(a.ref89, a.workdir)
    model = load_port(a.eager_rounding, a.workdir)
    hp = port.PRESETS["record"]
    ref = [a.torch_python, a.ref89]
    wj = os.path.join(a.workdir, "cmp_grads_jitter.npz")
    run([*ref, "jitter", a.weights, wj, "--rel", str(a.jitter_rel), "--seed", str(a.jitter_seed)])
    tokens = np.load(a.tokens)
    failures = 0
    for step in [int(s) for s in a.steps.split(",")]:
        g_path, gj_path = os.path.join(a.workdir, "cmp_grads_ref.npz"), os.path.join(a.workdir, "cmp_grads_jit.npz")
        run([*ref, "grads", a.weights, a.tokens, "--step", str(step), g_path])
        run([*ref, "grads", wj, a.tokens, "--step", str(step), gj_path])
        G, GJ = dict(np.load(g_path)), dict(np.load(gj_path))
        os.remove(g_path), os.remove(gj_path)
        with locked():
            P, loss = model.train_grads(model.load_weights(a.weights, hp), tokens, hp, step)
            P = {k: np.asarray(v, np.float32) for k, v in P.items()}
        print(f"\nstep {step}: loss ref {float(G['__loss__']):.4f} jittered {float(GJ['__loss__']):.4f} port {float(loss):.4f}")
        print(f"{'parameter':>22} {'port 1-cos':>10} {'noise 1-cos':>11} {'port norm':>9} {'noise norm':>10} zeros verdict")
        for name in port.param_shapes(hp):
            worst = None
            for label, g in pieces(name, G[name], hp):
                p = dict(pieces(name, P[name], hp))[label]
                gj = dict(pieces(name, GJ[name], hp))[label]
                dc, nr = distance(p, g)
                jc, jr = distance(gj, g)
                exact_zero_ok = not (g == 0).all() or (p == 0).all()  # exactly zero where the reference's is
                ok = exact_zero_ok and dc <= max(2 * jc, 1e-6) and abs(np.log(nr)) <= max(2 * abs(np.log(jr)), 1e-3)
                row = (label, dc, jc, nr, jr, exact_zero_ok, ok)
                if a.verbose and len(pieces(name, g, hp)) > 1:
                    print(f"{label:>22} {dc:10.2e} {jc:11.2e} {nr:9.4f} {jr:10.4f} {str(exact_zero_ok):>5} {'ok' if ok else 'OUT'}")
                if worst is None or (not ok and worst[-1]) or (ok == worst[-1] and dc - 2 * jc > worst[1] - 2 * worst[2]):
                    worst = row
            failures += not worst[-1]
            label, dc, jc, nr, jr, z, ok = worst
            print(f"{label:>22} {dc:10.2e} {jc:11.2e} {nr:9.4f} {jr:10.4f} {str(z):>5} {'ok' if ok else 'OUT'}")
    os.remove(wj)
    print(f"\n{failures} parameter(s) outside twice the reference's own noise")


if __name__ == "__main__":
    main()
