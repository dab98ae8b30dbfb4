"""The reference's optimizer alone: one ref89 optimizer step from given gradients, for
ref89_compare_update.py --noise. Runs under the torch venv's Python (torch is no project dependency),
outside the suite:

    TORCH_PY tests/ref89_apply_grads.py --ref89 PATH/ref89.py W.npz G.npz OUT.npz --step N [--jitter-rel R --seed S]

Loads W as ref89's `step` does, replays the schedule to step N, sets every parameter's gradient from G
(ref89's `grads` output), optionally times (1 + R * N(0, 1)) per element (the issue's "half a bf16
step" is R = 2e-3), runs the reference's own `step_optimizers(N)` from fresh state on one thread, and
writes the parameters as `step` writes them. With R = 0 every parameter equals `ref89.py step W T
--step N` on the tokens G came from, bit for bit (checked 2026-11-24 at step 1); the FP8 scale buffers
stay as loaded (no forward runs here).
"""
import argparse
import importlib.util
import os

import numpy as np
import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref89", required=True, help="path of ref89.py")
    ap.add_argument("weights")
    ap.add_argument("grads")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--jitter-rel", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    spec = importlib.util.spec_from_file_location("ref89", os.path.abspath(a.ref89))
    ref89 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref89)
    torch.set_num_threads(1)
    mod = ref89.load_reference(None, 8)
    names = ref89.load_weights(mod, a.weights)
    ref89.prepare_state(mod, a.step, names, eval_mode=False)
    G, rng = np.load(a.grads), np.random.default_rng(a.seed)
    for n, p in mod.model.named_parameters():
        if n in G.files:
            g = np.asarray(G[n], np.float32)
            if a.jitter_rel:
                g = np.asarray(g * (1 + a.jitter_rel * rng.standard_normal(g.shape)), np.float32)
            p.grad = torch.from_numpy(g).to(p.dtype)
    mod.training_manager.step_optimizers(a.step)
    ref89.save_npz(a.out, ref89.model_arrays(mod.model))


if __name__ == "__main__":
    main()
