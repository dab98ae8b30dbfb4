"""Writes tests/ref89_schedule.tsv: record 89's schedule as its own code computes it, for
test_hyperparameters.py to compare train_gpt.py's schedule functions with (not part of the suite).

    REF89_GIT=DIR ~/.cache/seed-torch-venv/bin/python tests/ref89_schedule.py --ref89 /work/shared/ref89/ref89.py \
        > tests/ref89_schedule.tsv

It runs under the reference's Python (torch), and takes from ref89.py only the exec of the reference's
schedule code (`load_loader`: TrainingSchedule, TRAINING_STAGES, get_muon_momentum, TrainingManager,
unchanged) and its sources; the reference's Yarn class is exec'd here, unchanged. For each step the
record's main loop visits (0 .. total, the last one validation only), it calls what the main loop
calls: TrainingManager.advance_schedule(step) (windows, batch size, document length, MTP and prefix
weights, and Yarn.apply at each long-window change), get_lr and get_muon_momentum (step_optimizers),
_is_adam_step; at the last step apply_final_ws_ext. Two presets, every step: `record` (the
reference's own constants) and `cpu` (train_gpt.py's cpu preset: the reference's classes given its
step counts, batch sizes, document lengths, momentum warm-up and cool-down and head size).
"""
import argparse
import importlib.util
import math
import sys
import types

import torch

CPU = dict(scheduled=24, extension=3, batch=(2048, 4096, 6144, 6144), seq=(256, 512, 512, 512), warmup=8,
           cooldown=4, head_dim=16)  # train_gpt.py's PRESETS["cpu"], written out


def load_ref89(path):
    spec = importlib.util.spec_from_file_location("ref89", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def yarn_class(ref89, ref_dir):
    src = ref89.read_ref_sources(ref_dir)[0]["train_gpt.py"]
    start, end = "class Yarn(nn.Module):", "@dataclass(slots=True)\nclass AttnArgs"
    assert src.count(start) == 1, "reference source changed: no single Yarn class"
    i = src.index(start)
    ns = {"torch": torch, "nn": torch.nn, "math": math, "device": torch.device("cpu")}
    exec(compile(src[i:src.index(end, i)], "train_gpt.py[record89 Yarn]", "exec"), ns)
    return ns["Yarn"]


def rows(L, Yarn, preset, sched, head_dim, warmup, cooldown):
    """The main loop's schedule at each step, with `sched` as the module's training_schedule."""
    g = L.TrainingManager.advance_schedule.__globals__  # the namespace load_loader exec'd
    g["training_schedule"] = sched
    tm = L.TrainingManager.__new__(L.TrainingManager)
    tm.model = types.SimpleNamespace(yarn=Yarn(head_dim, 8), yarn_paired_head=Yarn(head_dim, 8))
    tm.optimizer = types.SimpleNamespace(reset=lambda: None)
    tm.block_size, tm.split_step = 128, sched.split_step
    tm.reset()
    freqs, out = [], []
    for step in range(sched.total_steps + 1):
        tm.advance_schedule(step)
        last = step == sched.total_steps
        if last:
            tm.apply_final_ws_ext()
        y = tm.model.yarn
        assert torch.equal(y.angular_freq, tm.model.yarn_paired_head.angular_freq)
        f = tuple(float(v) for v in y.angular_freq.numpy())
        if f not in freqs:
            freqs.append(f)
        # get_forward_args' fields (its dataclass is outside load_loader's segment)
        out.append([preset, step, tm.batch_size, tm.train_max_seq_len, tm.ws_short * tm.block_size,
                    tm.ws_long * tm.block_size,
                    repr(sched.get_lr(step)),
                    repr(L.get_muon_momentum(step, muon_warmup_steps=warmup, muon_cooldown_steps=cooldown)),
                    int(tm._is_adam_step(step)), int(step == tm.split_step), int(last),
                    ",".join(repr(float(w)) for w in tm.mtp_weights.numpy()), repr(float(tm.prefix_weight)),
                    repr(y.attn_scale), freqs.index(f)])
    return out, [[preset, k, ",".join(map(repr, f))] for k, f in enumerate(freqs)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref89", required=True, help="ref89.py (the CPU reference's runner)")
    ap.add_argument("--ref-dir", help="a folder with the reference's sources (default: REF89_GIT at its commit)")
    a = ap.parse_args()
    ref89 = load_ref89(a.ref89)
    L, Yarn = ref89.load_loader(a.ref_dir, 8, 0), yarn_class(ref89, a.ref_dir)
    s = L.training_schedule
    record, record_f = rows(L, Yarn, "record", s, 128, 300, 50)
    stages = [L.TrainingStage(**{**{f: getattr(st, f) for f in st.__slots__}, "batch_size": b, "train_max_seq_len": q})
              for st, b, q in zip(L.TRAINING_STAGES, CPU["batch"], CPU["seq"])]
    cpu_s = L.TrainingSchedule(stages, CPU["scheduled"], CPU["extension"], cooldown_frac=s.cooldown_frac)
    cpu, cpu_f = rows(L, Yarn, "cpu", cpu_s, CPU["head_dim"], CPU["warmup"], CPU["cooldown"])
    w = sys.stdout.write
    source = a.ref_dir or f"KellerJordan/modded-nanogpt {ref89.COMMIT}"
    w(f"# record 89's schedule by its own code ({source} train_gpt.py:\n"
      "# TrainingSchedule, get_muon_momentum, TrainingManager.advance_schedule, Yarn), written by\n"
      "# tests/ref89_schedule.py (its docstring: the command).\n"
      "# step rows: what the main loop's step uses; windows in tokens; lr and momentum as Python floats; mtp,\n"
      "# prefix: float32 values; split: the step after whose update embed and lm_head are untied; last: the\n"
      "# final validation's step (long window widened); freq: the number of a freq row, whose step column holds\n"
      "# that number and whose batch column the rotary base frequencies Yarn has then (float32).\n")
    w("\t".join(["kind", "preset", "step", "batch", "max_seq_len", "ws_short", "ws_long", "lr", "momentum", "adam",
                 "split", "last", "mtp", "prefix", "attn_scale", "freq"]) + "\n")
    for r in record + cpu:
        w("\t".join(map(str, ["step", *r])) + "\n")
    for r in record_f + cpu_f:
        w("\t".join(map(str, ["freq", *r])) + "\n")


if __name__ == "__main__":
    main()
