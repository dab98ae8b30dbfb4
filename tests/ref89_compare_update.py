"""The record-89 optimizer alone against the torch reference (issue 33's "Optimizer alone, near-exact" check).

For each step N: ref89's `grads W T --step N G.npz` (the train-mode gradients) and `step W T --step N
S.npz` (one reference optimizer step from fresh state, on its own gradients of the same weights and
tokens: the same code path, so the same gradients), then train_gpt.apply_update(W, G,
hp, N) against S, parameter by parameter:
  NorMuon banks, per matrix (matrices whose gradient is all zero, the banks' padding, apart, element by
    element): the brief's bound, update (new - W) cosine >= 0.999 and norm within 0.5% of ref89's, is
    printed but not judged: on these gradients (one 2048-token batch, fresh momentum: 40-96% of the
    singular values below 1e-3 of the largest) Polar Express amplifies rounding differences along the
    tiny singular directions, so two bf16 implementations disagree by more than that. Judged instead:
    both updates against exact arithmetic (float64 NorMuon, stored by the same truncation), ours no
    farther from it than ref89's: 1 - cos <= 1.5 (1 - cos_ref89) + 1e-4, |norm/exact - 1| <= 1.5 x
    ref89's + 2e-3;
  bf16 Adam parameters: elements at most one bf16 step apart, except where w - update cancels (then
    within 4 fp32 ulps of |w| + |update|, the precision of the fp32 subtraction itself);
  fp32 parameters: max |ours - ref| / |ref| <= 1e-5.
--noise adds the reference's distance to itself, as the gradient checks have it: ref89's optimizer
(tests/ref89_apply_grads.py) on the same gradients jittered by --jitter-rel per element, per bank
matrix beside ours (printed, not judged).
The FP8 scale buffers are passed through by apply_update (the reference's forward rewrites them):
shown, not judged. Use odd N (Adam steps only on odd steps); for N > 847 ref89 treats the embedding
as already untied, and so does apply_update.

Not collected by pytest. Every ref89 run and our real-size run holds the flock on /tmp/ref89.lock;
ref89 runs single-threaded (reproducible on a busy machine; checked: the step's loss equals grads').

  REF89_GIT=/work/.mirror/KellerJordan+modded-nanogpt/repo .venv/bin/python tests/ref89_compare_update.py \
      --torch-python ~/.cache/seed-torch-venv/bin/python --ref89 /work/shared/ref89/ref89.py \
      --weights /tmp/x/W1.npz --tokens /tmp/x/T.npy --steps 1,423,847,1271 --workdir /tmp/x [--noise]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import train_gpt as tg  # noqa: E402
from ref89_compare_grads import LOCK, locked, ref89_as_compiled  # noqa: E402  (this folder is sys.path[0])

FP8_BUFFERS = ("_mlp_down_act_scales", "_mlp_down_proj_scales", "_mlp_down_proj_next_scales")


def torch_run(a, label, *argv):
    """A torch-side script under the lock (each side needs 10-15 GB), its time printed under `label`."""
    t = time.time()
    subprocess.run(["flock", LOCK, a.torch_python, *argv], check=True, stdout=subprocess.DEVNULL)
    print(f"  {label}: {time.time() - t:.0f} s", flush=True)


def ref89(a, *cmd):
    """One ref89 command, single-threaded: with 2 threads its results change when the machine is busy
    (measured: a `grads` run beside two busy processes differed from an idle one in 60% of the qk_bank
    gradient, loss 31516.197 vs 31516.371); with 1 thread they were identical."""
    torch_run(a, f"ref89 {cmd[0]} --step {cmd[cmd.index('--step') + 1]}", a.ref89, "--threads", "1", *cmd)


def ordered_bf16(x):
    """bf16 values as integers in value order (sign-magnitude bits -> two's complement), so that the
    difference of two is their distance in bf16 steps."""
    bits = (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.int32)  # x holds bf16 values
    return np.where(bits >= 0x8000, 0x8000 - bits, bits)


def cosine(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(a.ravel() @ b.ravel() / (na * nb)) if na and nb else float(na == nb)


def exact_normuon(w, g, m, lr_N, wd, hp):
    """The bank after one NorMuon step from fresh state in float64 (no rounding anywhere but the fp32
    lrs both sides use: lr_N per matrix, wd), stored as the port stores it (the fp32 value truncated to
    bf16): the yardstick for both implementations."""
    X = (1 - m * m) * g  # lerp(g, buf, m) with buf = lerp(0, g, 1 - m)
    X = X / (np.linalg.norm(X, axis=(-2, -1), keepdims=True) * 1.02 + 1e-6)
    tall = X.shape[-2] > X.shape[-1]
    for a, b, c in tg.POLAR_EXPRESS_COEFFS:
        A = X.swapaxes(-1, -2) @ X if tall else X @ X.swapaxes(-1, -2)
        B = b * A + c * A @ A
        X = a * X + (X @ B if tall else B @ X)
    axis = -1 if X.shape[-2] >= X.shape[-1] else -2
    v_mean = np.mean(X * X, axis=axis, keepdims=True)
    scaled = X / np.sqrt((1 - hp.muon_beta2) * v_mean)  # the first second-moment lerp from zero
    v = scaled * np.linalg.norm(X, axis=(-2, -1), keepdims=True) / np.linalg.norm(scaled, axis=(-2, -1), keepdims=True)
    lr_N = np.float64(lr_N)[:, None, None]
    new = (w - w * (v * w >= 0) * wd * lr_N - v * lr_N).astype(np.float32)
    return (new.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)


def compare_bank(name, w, ours, ref, g, sv, hp, jittered=None):
    """The brief's bound (update cosine >= 0.999, norm within 0.5% of ref89's, per matrix), and each side's
    distance to exact arithmetic: ours must be no farther from it than the reference is (x1.5 + 1e-4).
    jittered: ref89's own update from the gradients jittered (--noise), its distance to ref89 shown
    beside ours, as the gradient checks show theirs (printed, not judged)."""
    shape = (-1, *w.shape[-2:])
    w, ours, ref, g = (x.reshape(shape).astype(np.float64) for x in (w, ours, ref, g))
    real = [i for i in range(len(w)) if np.any(g[i])]
    pad = [i for i in range(len(w)) if i not in real]
    exact = exact_normuon(w[real], g[real], float(sv["momentum"]), sv["normuon_lr"][name][real],
                          float(sv["normuon_wd"][name]), hp)
    d_ours, d_ref, d_exact = ours[real] - w[real], ref[real] - w[real], exact - w[real]
    cos = np.array([cosine(x, y) for x, y in zip(d_ours, d_ref)])
    ratio = np.linalg.norm(d_ours, axis=(1, 2)) / np.linalg.norm(d_ref, axis=(1, 2))
    ours_exact = np.array([cosine(x, y) for x, y in zip(d_ours, d_exact)])
    ref_exact = np.array([cosine(x, y) for x, y in zip(d_ref, d_exact)])
    norm_exact = np.linalg.norm(d_exact, axis=(1, 2))
    off_ours = np.abs(np.linalg.norm(d_ours, axis=(1, 2)) / norm_exact - 1)
    off_ref = np.abs(np.linalg.norm(d_ref, axis=(1, 2)) / norm_exact - 1)
    brief = cos.min() >= 0.999 and np.abs(ratio - 1).max() <= 5e-3
    ok = bool(np.all(1 - ours_exact <= 1.5 * (1 - ref_exact) + 1e-4) and np.all(off_ours <= 1.5 * off_ref + 2e-3))
    pad_diff = max((float(np.abs(ours[i] - ref[i]).max()) for i in pad), default=0.0)
    noise = ""
    if jittered is not None:
        d_jit = jittered.reshape(shape).astype(np.float64)[real] - w[real]
        cos_jit = np.array([cosine(x, y) for x, y in zip(d_jit, d_ref)])
        ratio_jit = np.linalg.norm(d_jit, axis=(1, 2)) / np.linalg.norm(d_ref, axis=(1, 2))
        times = (1 - cos) / np.maximum(1 - cos_jit, 1e-12)
        noise = (f" | ref89 vs itself on jittered gradients: cos min {cos_jit.min():.5f} mean {cos_jit.mean():.5f}, "
                 f"|norm ratio-1| max {np.abs(ratio_jit - 1).max():.1e}; ours' 1 - cos / its, per matrix: "
                 f"max {times.max():.2f}, {int(np.sum(times > 2))} above 2")
    return ok, (f"{len(real)} matrices | vs ref89: cos min {cos.min():.5f} (#{real[cos.argmin()]}) "
                f"mean {cos.mean():.5f}, "
                f"|norm ratio-1| max {np.abs(ratio - 1).max():.1e} [brief's bound {'met' if brief else 'NOT met'}] | "
                f"vs exact f64: ours cos min {ours_exact.min():.5f} mean {ours_exact.mean():.5f}, ref89 min "
                f"{ref_exact.min():.5f} mean {ref_exact.mean():.5f}, |norm ratio-1| max ours {off_ours.max():.1e} "
                f"ref89 {off_ref.max():.1e} | padding {pad or '-'}: max|ours-ref| {pad_diff:.0e}{noise}")


def compare_adam(name, w, ours, ref):
    """fp32: within 1e-5 relative. bf16: at most one bf16 step apart, except where w - update cancels
    (the fp32 result is only good to an ulp of w): there within 4 fp32 ulps of |w| + |update|.
    Row blocks of ~8M elements keep the float64 temporaries small (the embeddings have 290M)."""
    if tg.param_shapes(tg.PRESETS["record"])[name][1] == jnp.float32:
        rel = float(np.max(np.abs(ours - ref) / np.maximum(np.abs(ref), 1e-30)))
        upd = cosine(ours.astype(np.float64) - w, ref.astype(np.float64) - w)
        return rel <= 1e-5, f"fp32: max rel diff {rel:.1e}; update cos {upd:.6f}"
    rows = max(1, (1 << 23) // w[0].size)  # bf16 parameters are never 0-d
    dot = n_ours = n_ref = 0.0
    steps = differing = moved = far = 0
    ulps = 0.0
    for i in range(0, len(w), rows):
        wi, oi, ri = (x[i:i + rows].astype(np.float64) for x in (w, ours, ref))
        dot += np.sum((oi - wi) * (ri - wi))
        n_ours, n_ref = n_ours + np.sum((oi - wi) ** 2), n_ref + np.sum((ri - wi) ** 2)
        d = np.abs(ordered_bf16(oi) - ordered_bf16(ri))
        steps, differing = max(steps, int(d.max())), differing + int(np.sum(d > 0))
        moved += int(np.sum(ri != wi))
        f = d > 1
        far += int(f.sum())
        if f.any():
            scale = (np.abs(wi[f]) + np.abs(ri[f] - wi[f])) * 2.0 ** -23
            ulps = max(ulps, float(np.max(np.abs(oi[f] - ri[f]) / scale)))
    upd = dot / np.sqrt(n_ours * n_ref) if n_ours and n_ref else float(n_ours == n_ref)
    return far == 0 or ulps <= 4, (
        f"bf16 steps apart: max {steps}, elements differing {differing / w.size:.1e}, >1 step {far}"
        f"{f' (cancellation: within {ulps:.1f} fp32 ulps of |w|+|update|)' if far else ''}; "
        f"update cos {upd:.6f}; elements moved {moved / w.size:.3f}")


def compare(a, step, G_path, S_path, J_path=None):
    hp = tg.PRESETS["record"]
    W, G, S = np.load(a.weights), np.load(G_path), np.load(S_path)
    J = np.load(J_path) if J_path else None
    params = {n: jnp.asarray(W[n], tg.param_shapes(hp)[n][1]) if n in tg.PARAM_TABLE else W[n]
              for n in W.files if not n.startswith("__")}
    grads = {n: jnp.asarray(G[n], tg.param_shapes(hp)[n][1]) for n in tg.PARAM_TABLE}
    t = time.time()
    out = tg.apply_update(params, grads, hp, step)
    jax.block_until_ready(out)
    del params, grads
    print(f"  apply_update (compile + run, CPU): {time.time() - t:.0f} s")
    sv = tg.step_values_at(step, hp, first_step=step)
    print(f"step {step}: lr x{tg.lr_mul(step, hp):.6f} momentum {float(sv['momentum']):.6f} adam {bool(sv['do_adam'])} "
          f"tied {bool(sv['tied'])} split {bool(sv['split'])}")
    same_loss = float(S["__losses__"][0]) == float(G["__loss__"])
    print(f"  ref89 step's loss {float(S['__losses__'][0]):.6f}, grads' loss {float(G['__loss__']):.6f}: "
          f"{'equal (its step saw these gradients)' if same_loss else 'DIFFERENT: its step saw other gradients'}")
    all_ok = same_loss
    for n in S.files:
        if n.startswith("__"):
            continue
        ref, ours = S[n].astype(np.float32), np.asarray(jnp.asarray(out[n]).astype(jnp.float32))
        w = W[n].astype(np.float32)
        if n not in tg.PARAM_TABLE:
            note = "not judged: the reference's forward rewrites the FP8 scales" if n in FP8_BUFFERS else ""
            print(f"  {n:22s} {'buffer':8s} -- passed through: equal to ref89's {np.array_equal(ours, ref)} "
                  f"(max|diff| {np.abs(ours - ref).max():.1e}) {note}")
            all_ok &= n in FP8_BUFFERS or np.array_equal(ours, ref)
            continue
        if tg.PARAM_TABLE[n]["optim"] == "normuon":
            ok, text = compare_bank(n, w, ours, ref, G[n].astype(np.float64), sv, hp, None if J is None else J[n])
        else:
            ok, text = compare_adam(n, w, ours, ref)
        all_ok &= ok
        print(f"  {n:22s} {tg.PARAM_TABLE[n]['optim']:8s} {'ok  ' if ok else 'FAIL'} {text}", flush=True)
    return all_ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-python", required=True, help="the torch venv's python")
    ap.add_argument("--ref89", required=True, help="path of ref89.py")
    ap.add_argument("--weights", required=True, help="W.npz (moved off init: e.g. ref89 `step` of the init at step 1)")
    ap.add_argument("--tokens", required=True, help="T.npy (ref89 `tokens`)")
    ap.add_argument("--steps", default="1,423,847,1271")
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help="where the 2.6 GB G/S files go (deleted after each step)")
    ap.add_argument("--keep", action="store_true", help="keep G<N>.npz and S<N>.npz (and reuse them if present)")
    ap.add_argument("--noise", action="store_true", help="also ref89's own update from the gradients jittered by "
                    "--jitter-rel (tests/ref89_apply_grads.py), beside ours per bank matrix")
    ap.add_argument("--jitter-rel", type=float, default=2e-3)
    ap.add_argument("--jitter-seed", type=int, default=0)
    a = ap.parse_args()
    a.ref89 = ref89_as_compiled(a.ref89, a.workdir)
    results = {}
    for step in [int(s) for s in a.steps.split(",")]:
        G_path, S_path = (os.path.join(a.workdir, f"{k}{step}.npz") for k in "GS")
        if not (a.keep and os.path.exists(G_path) and os.path.exists(S_path)):
            ref89(a, "grads", a.weights, a.tokens, "--step", str(step), G_path)
            ref89(a, "step", a.weights, a.tokens, "--step", str(step), S_path)
        J_path = os.path.join(a.workdir, f"J{step}.npz") if a.noise else None
        if a.noise:  # ref89_apply_grads sets one thread itself
            torch_run(a, f"ref89 optimizer on jittered gradients --step {step}",
                      os.path.join(ROOT, "tests", "ref89_apply_grads.py"), "--ref89", a.ref89, a.weights, G_path,
                      J_path, "--step", str(step), "--jitter-rel", str(a.jitter_rel), "--seed", str(a.jitter_seed))
        with locked():
            results[step] = compare(a, step, G_path, S_path, J_path)
        for path in ([J_path] if a.noise else []) + ([] if a.keep else [G_path, S_path]):
            os.remove(path)
    bad = [s for s, ok in results.items() if not ok]
    print(f"OUT OF BOUNDS at steps {bad}" if bad else "all within bounds")


if __name__ == "__main__":
    main()
