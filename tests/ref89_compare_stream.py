"""The residual stream of the port against the PyTorch record-89 reference (ref89.py), outside the suite.

    python tests/ref89_compare_stream.py --ref89 PATH/ref89.py --torch-python PATH/python \
        --weights W.npz --tokens T.npy --step 1 [--eager-rounding] [--workdir DIR]

Every rms-norm of the residual stream (23 per forward: the embedding, each layer's attention and MLP
input, the final norm) is probed on both sides, in call order: its input (forward) and the gradient
of sum(loss) x grad scale with respect to it. A norm's input gradient scales as 1 / |input|, so a
drift of the stream's size shows as an opposite drift of every gradient upstream.

--eager-rounding: the port with ref89's eager rounding of the residual updates (ref89_compare_grads.py).
"""
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ref89_compare_grads import LOCK, load_port, locked, parser, ref89_as_compiled  # noqa: E402

REF_SIDE = r'''
import sys, types, numpy as np, torch
sys.path.insert(0, sys.argv[1])
import ref89 as R
torch.set_num_threads(1)
a = types.SimpleNamespace(ref_dir=None, world_size=8, weights=sys.argv[2], tokens=sys.argv[3], step=int(sys.argv[4]),
                          stage=None, eval=False)
mod, batch, info = R._load_for_loss(a)
norm, seen = mod.norm, []
def probe(x):  # a clone per call: its gradient is this call's alone
    if x.shape[-1] != mod.model.embed.weight.shape[1]:
        return norm(x)  # QK norms
    y = x.clone(); y.retain_grad(); seen.append(y); return norm(y)
mod.norm = probe
(R.forward(mod, batch).sum() * mod.grad_scale).backward()
np.savez(sys.argv[5], **{f"x{i:02d}": y.detach().float().numpy().reshape(-1, y.shape[-1]) for i, y in enumerate(seen)},
         **{f"g{i:02d}": y.grad.float().numpy().reshape(-1, y.shape[-1]) for i, y in enumerate(seen)})
'''

def port_side(port, weights, tokens, step):
    import jax
    import jax.numpy as jnp
    hp = port.PRESETS["record"]
    params = port.load_weights(weights, hp)
    inputs, targets, _ = port.padded_sequence(tokens, hp.bos_id)
    a, extra = port.schedule_values(step, hp), port.training_inputs(params, targets, step, hp)
    norm, state = port.rms_norm, {}
    D = params["embed.weight"].shape[1]

    def probe(x, eps=port.F32_EPS):  # stream norms get a zero added: its gradient is this call's
        if x.shape[-1] == D and eps == port.F32_EPS:
            if state["probes"] is None:
                state["shapes"].append(x.shape)
            else:
                x = x + state["probes"][len(state["xs"])].astype(x.dtype)
            state["xs"].append(jax.lax.stop_gradient(x))
        return norm(x, eps)

    def loss(probes, params, inputs, targets, a, extra):  # arrays as arguments: no constant folding
        state.update(probes=probes, shapes=[], xs=[])
        return port.sequence_loss(params, inputs, targets, a, True, *extra)[0], list(state["xs"])

    port.rms_norm = probe
    try:
        state.update(probes=None, shapes=[], xs=[])
        jax.eval_shape(lambda *args: port.sequence_loss(*args, True, *extra), params, inputs, targets, a)
        probes = [jnp.zeros(s, jnp.float32) for s in state["shapes"]]
        (value, xs), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(probes, params, inputs, targets, a, extra)
    finally:
        port.rms_norm = norm
    n = len(tokens) - 1  # the padding behind the sequence is not the reference's
    return float(value), [np.asarray(x, np.float64)[:n] for x in xs], [np.asarray(v, np.float64)[:n] for v in g]


def compare(a, b):
    a, b = a.ravel(), b.ravel()
    return np.linalg.norm(b) / np.linalg.norm(a), 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def main():
    ap = parser(__doc__)
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--eager-rounding", action="store_true", help="the port with ref89's eager residual rounding")
    a = ap.parse_args()
    a.ref89 = ref89_as_compiled(a.ref89, a.workdir)
    out = os.path.join(a.workdir, "cmp_stream_ref.npz")
    subprocess.run(["flock", LOCK, a.torch_python, "-c", REF_SIDE, os.path.dirname(os.path.abspath(a.ref89)),
                    a.weights, a.tokens, str(a.step), out], check=True)
    R = dict(np.load(out))
    os.remove(out)
    with locked():
        loss, xs, gs = port_side(load_port(a.eager_rounding, a.workdir), a.weights, np.load(a.tokens), a.step)
    calls = len([k for k in R if k.startswith("x")])
    assert calls == len(xs), f"ref89 normed the stream {calls} times, the port {len(xs)}"
    print(f"step {a.step}, port loss {loss:.4f}{' (eager rounding)' if a.eager_rounding else ''}")
    print(f"{'call':>4} {'input norm ratio':>16} {'input 1-cos':>11} {'grad norm ratio':>15} {'grad 1-cos':>10}")
    for i in range(calls):
        xr, xc = compare(R[f"x{i:02d}"].astype(np.float64), xs[i])
        gr, gc = compare(R[f"g{i:02d}"].astype(np.float64), gs[i])
        print(f"{i:4d} {xr:16.5f} {xc:11.1e} {gr:15.4f} {gc:10.1e}")


if __name__ == "__main__":
    main()
