"""Whole training steps of the port against the PyTorch record-89 reference (ref89.py), outside the suite.

    python tests/ref89_compare_steps.py --ref89 PATH/ref89.py --torch-python PATH/python \
        --weights W.npz --tokens T.npy[,T2.npy] --steps 1,423,847,1271 [--workdir DIR] [--jitter-rel 2e-3]
        [--eager-rounding]

For each start step N: ref89 `step W TOKENS --step N` (one step per token file), the same on W
jittered by half a bf16 step (the reference's own noise), and the port's train_steps. Compared per
parameter (banks per matrix, padding skipped) on the update (after - before): 1 - cosine and norm
ratio of the port's update vs the reference's, next to the jittered reference's vs the reference's;
a parameter is within noise when the port's distance is at most twice the noise's. ref89 runs under
`flock /tmp/ref89.lock` (each side needs 10-15 GB); outputs are deleted.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as port  # noqa: E402

from ref89_compare_grads import distance, load_port, locked, parser, pieces, ref89_as_compiled, run  # noqa: E402


def main():
    ap = parser(__doc__, "one .npy per step, comma-separated")
    ap.add_argument("--steps", default="1,423,847,1271")
    ap.add_argument("--jitter-rel", type=float, default=2e-3)
    ap.add_argument("--eager-rounding", action="store_true", help="the port with ref89's eager residual rounding")
    a = ap.parse_args()
    a.ref89 = ref89_as_compiled(a.ref89, a.workdir)
    hp = port.PRESETS["record"]
    model = load_port(a.eager_rounding, a.workdir)
    ref = [a.torch_python, a.ref89]
    wj = os.path.join(a.workdir, "cmp_steps_jitter.npz")
    run([*ref, "jitter", a.weights, wj, "--rel", str(a.jitter_rel)])
    token_arrays = [np.load(t) for t in a.tokens.split(",")]
    failures = 0
    W, WJ = np.load(a.weights), np.load(wj)  # read per array on access: the machine's memory is shared
    for step in [int(s) for s in a.steps.split(",")]:
        s_path, sj_path = os.path.join(a.workdir, "cmp_steps_ref.npz"), os.path.join(a.workdir, "cmp_steps_jit.npz")
        run([*ref, "step", a.weights, a.tokens, "--step", str(step), s_path])
        run([*ref, "step", wj, a.tokens, "--step", str(step), sj_path])
        with locked():
            out = model.train_steps(model.load_weights(a.weights, hp), token_arrays, hp, step)
            P = {k: np.asarray(v, np.float32) for k, v in out.items()}
            del out
        S, SJ = np.load(s_path), np.load(sj_path)
        print(f"\nsteps {step}..{step + len(token_arrays) - 1}: losses ref {S['__losses__'].round(3).tolist()} "
              f"jittered {SJ['__losses__'].round(3).tolist()} port {P['__losses__'].round(3).tolist()}")
        print(f"{'parameter':>22} {'port 1-cos':>10} {'noise 1-cos':>11} {'port norm':>9} {'noise norm':>10} verdict")
        for name in port.param_shapes(hp):
            worst = None
            for label, u in pieces(name, S[name] - W[name], hp):
                p = dict(pieces(name, P[name] - W[name], hp))[label]
                uj = dict(pieces(name, SJ[name] - WJ[name], hp))[label]
                dc, nr = distance(p, u)
                jc, jr = distance(uj, u)
                ok = dc <= max(2 * jc, 1e-6) and abs(np.log(nr)) <= max(2 * abs(np.log(jr)), 1e-3)
                row = (label, dc, jc, nr, jr, ok)
                if worst is None or (not ok and worst[-1]) or (ok == worst[-1] and dc - 2 * jc > worst[1] - 2 * worst[2]):
                    worst = row
            failures += not worst[-1]
            label, dc, jc, nr, jr, ok = worst
            print(f"{label:>22} {dc:10.2e} {jc:11.2e} {nr:9.4f} {jr:10.4f} {'ok' if ok else 'OUT'}")
        for name in ("_mlp_down_act_scales", "_mlp_down_proj_scales", "_mlp_down_proj_next_scales"):
            rel = np.abs(P[name] - S[name]) / np.abs(S[name])
            print(f"{name:>28}: max relative difference {rel.max():.2e}")
        S.close(), SJ.close()
        os.remove(s_path), os.remove(sj_path)
    os.remove(wj)
    print(f"\n{failures} parameter(s) outside twice the reference's own noise")


if __name__ == "__main__":
    main()
