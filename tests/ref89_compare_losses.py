"""Per-token losses of the port against the PyTorch record-89 reference (ref89.py), outside the suite.

    python tests/ref89_compare_losses.py --ref89 PATH/ref89.py --torch-python PATH/python \
        --weights W.npz --tokens T.npy --eval-tokens TV.npy [--cases s0,s1,s2,s3,eval,final] [--workdir DIR]

For each case it runs `ref89.py loss ... --out` (under `flock /tmp/ref89.lock`: each side needs
10-15 GB, run one at a time), then the port's loss_fn on the same weights and tokens, and prints the
mean losses, their relative difference (the issue's bound: 1e-3) and the per-token differences (mean,
max). Cases: sK = training at the first step of stage K (ref89 --stage K), stepN = training at step
N, eval = validation at stage 2, final = the final validation (long window 20 blocks, no YaRN update).
"""
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as port  # noqa: E402
from ref89_compare_grads import locked, parser, ref89_as_compiled  # noqa: E402


def case_args(case, hp):
    """(ref89 arguments, step, training, final_val) of a case name."""
    if case.startswith("s") and case[1:].isdigit():
        k = int(case[1:])
        return ["--stage", str(k)], port.stage_bounds(hp)[k][0], True, False
    if case.startswith("step"):
        return ["--step", case[4:]], int(case[4:]), True, False
    if case == "eval":
        return ["--stage", "2", "--eval"], port.stage_bounds(hp)[2][0], False, False
    if case == "final":
        return ["--stage", "3", "--eval", "--final-val"], port.stage_bounds(hp)[3][0], False, True
    raise SystemExit(f"unknown case {case!r}")


def main():
    ap = parser(__doc__)
    ap.add_argument("--eval-tokens", help="tokens for eval/final (default: --tokens)")
    ap.add_argument("--cases", default="s0,s1,s2,s3,eval,final")
    a = ap.parse_args()
    a.ref89 = ref89_as_compiled(a.ref89, a.workdir)
    hp = port.PRESETS["record"]
    weights = port.load_weights(a.weights, hp)
    print(f"{'case':>8} {'step':>5} {'ref mean':>10} {'port mean':>10} {'rel diff':>9} {'tok mean|d|':>11} {'tok max|d|':>10}")
    for case in a.cases.split(","):
        ref_args, step, training, final_val = case_args(case, hp)
        tokens = a.tokens if training or not a.eval_tokens else a.eval_tokens
        out = os.path.join(a.workdir, f"ref89_loss_{case}.npy")
        t0 = time.time()
        subprocess.run(["flock", "/tmp/ref89.lock", a.torch_python, a.ref89, "loss", a.weights, tokens, *ref_args,
                        "--out", out], check=True, stdout=subprocess.DEVNULL)
        ref = np.load(out)
        os.remove(out)
        with locked():
            ours = np.asarray(port.loss_fn(weights, np.load(tokens), hp, step, training, final_val))
        d = np.abs(ours.astype(np.float64) - ref)
        rel = abs(ours.mean() - ref.mean()) / abs(ref.mean())
        print(f"{case:>8} {step:>5} {ref.mean():10.5f} {ours.mean():10.5f} {rel:9.2e} {d.mean():11.4f} {d.max():10.4f}"
              f"   ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
