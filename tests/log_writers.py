"""Record logs written by hand, in our layout (as train_gpt.py writes them) and in the PyTorch
speedrun's, for the tests of records/ (test_records checks the first against the real trainer's)."""
import dataclasses
import json
import math

import numpy as np

import train_gpt as tg  # only for its Hyperparameters and source; the log lines are written here

RULE = "=" * 100
HP = dataclasses.replace(tg.PRESETS["cpu"], num_scheduled_iterations=40, num_extension_iterations=0, val_loss_every=10)


def hp_with(steps, **overrides):
    """HP with `steps` steps (all scheduled) and other overrides."""
    return dataclasses.replace(HP, num_scheduled_iterations=steps, **overrides)


def val_line(step, N, loss, ms, timed=None):
    """A val line as both speedruns print it; `timed` = steps the clock covers (None: all `step`, and
    step 0's average 0.00 as ours and record 89 print it; 0: nan, as older PyTorch records did)."""
    timed = max(step, 1) if timed is None else timed
    avg = ms / timed if timed else math.nan
    return f"step:{step}/{N} val_loss:{loss:.4f} train_time:{ms:.0f}ms step_avg:{avg:.2f}ms"


def train_line(step, N, ms, timed=None):
    timed = step if timed is None else timed
    return f"step:{step}/{N} train_time:{ms:.0f}ms step_avg:{ms / timed if timed else math.nan:.2f}ms"


# ---- our layout, written here (README.md, "Record logs"); test_records checks it against train()'s

def write_log(path, hp, val_losses, step_ms, end="complete"):
    """Header, info and compile lines, a val line every val_loss_every steps and at the end, a
    train line per step (step_ms: each step's time, or a list of them), then the summary and `run
    complete` (or, for end="interrupted"/"stopped", the line train() writes when that happens half-way)."""
    with open(tg.__file__) as f:
        lines = [f.read().rstrip("\n"), RULE, "Running Python 3.11.9 (main) [GCC 12.2.0]",
                 "Running jax 0.10.2 jaxlib 0.10.2 optax 0.2.5 numpy 2.2.6 on Linux-x86_64",
                 "Devices: 1 x cpu (cpu) in 1 process(es)", "nvidia-smi: not available", RULE,
                 "Hyperparameters (preset cpu):", json.dumps(dataclasses.asdict(hp), indent=1), RULE]
    N, every, batch = hp.total_steps, hp.val_loss_every, hp.stages[0].batch_size  # one batch size, for simplicity
    lines += [f"preset cpu: {N} steps ({N} scheduled + 0 extension), stages at {[b[0] for b in tg.stage_bounds(hp)]}, "
              f"batch {[s.batch_size for s in hp.stages]} tokens as 8 chunks, 1 device(s), 8 chunk(s) per device per "
              f"step, attention {hp.attention}, dc {hp.dc}, mlp {hp.mlp}, head {hp.head}; log {path}",
              "compile: 12.3s for 3 train programs and the validation step (persistent cache: off)"]
    train_ms, val = 0.0, iter(val_losses)
    for step in range(N + 1):
        if step == N or step % every == 0:
            val_loss = next(val)
            lines.append(val_line(step, N, val_loss, train_ms))
        if step == N:
            break
        if step == N // 2 and end != "complete":
            lines.append({"interrupted": f"interrupted at step {step} (SIGINT)",
                          "stopped": f"stopped: non-finite train loss nan at step {step}"}[end])
            break
        train_ms += step_ms[step] if np.ndim(step_ms) else step_ms
        lines.append(train_line(step + 1, N, train_ms))
    if end == "complete":
        lines += [f"summary final_val_loss:{val_loss:.4f} train_time:{train_ms:.0f}ms step_avg:{train_ms / N:.2f}ms "
                  f"tokens_per_s:{N * batch / train_ms * 1000:.0f} compile_s:12.3 peak_memory:n/a",
                  "run complete"]
    with open(path, "x") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def random_curve(rng, n=5):
    """n decreasing val losses."""
    return list(np.sort(rng.uniform(3, 10, n))[::-1].round(4))


# ---- the PyTorch speedrun's layout (records 18-22), written here

TORCH_HYPERPARAMETERS = """\
    # data
    train_files = "data/fineweb10B/fineweb_train_*.bin" # training shards
    val_files = "data/fineweb10B/fineweb_val_*.bin" # validation shards
    val_tokens = 10485760 # fixed, for comparable val losses
    # optimization
    batch_size = 8*64*1024 # tokens per step
    num_iterations = {N} # steps
    cooldown_frac = 0.4 # last part of training with a decaying lr
    # evaluation and logging
    val_loss_every = {every} # 0: only at the end
    # implementation
    seq_len = 64*1024 # tokens per GPU
    save_checkpoint = False
"""
# the 2025-01-26 records: shorter sequences, more steps, and no batch size among the hyperparameters
TORCH_0126_HYPERPARAMETERS = """\
    train_files = "data/fineweb10B/fineweb_train_*.bin" # training shards
    val_files = "data/fineweb10B/fineweb_val_*.bin" # validation shards
    val_tokens = 10485760 # fixed
    num_iterations = {N} # steps
    cooldown_frac = 0.4 # lr decay
    val_loss_every = {every} # 0: only at the end
    seq_len = 48*1024 # tokens per GPU
    save_checkpoint = False
"""

# record 89 (2026): annotated fields, a schedule in two parts, no batch size (it is in the stage table)
TORCH_89_HYPERPARAMETERS = """\
    train_files: str = "data/fineweb10B/fineweb_train_*.bin" # input .bin to train on
    val_files: str = "data/fineweb10B/fineweb_val_*.bin" # input .bin to eval validation loss on
    val_tokens: int = 10485760 # fixed for consistent comparisons
    val_batch_size: int = 4 * 64 * 1024 * 8
    num_scheduled_iterations: int = {N} - 15  # number of steps to complete lr and ws schedule
    num_extension_iterations: int = 15  # number of steps to continue training at final lr and ws
    val_loss_every: int = {every}  # 0 for only at the end
    save_checkpoint: bool = False
    bigram_vocab_size: int = 50304 * 15 // 2
"""

TORCH_SCRIPT = '''import os
import sys
with open(sys.argv[0]) as f:
    code = f.read()  # logged below
from dataclasses import dataclass

import torch


@dataclass
class Hyperparameters:
{hyperparameters}args = Hyperparameters()


def print0(s):
    with open(logfile, "a") as f:
        print(s, file=f)


print0(code)
print0("=" * 100)
print0(f"step:{{step}}/{{args.num_iterations}} train_time:{{t:.0f}}ms")
'''

NVIDIA_SMI = """Fri Jan 17 05:37:55 2025
+-----------------------------------------------------------+
| NVIDIA-SMI 550.127.05    Driver Version: 550.127.05       |
|===========================================================|
|   0  NVIDIA H100 80GB HBM3   On  |   7746MiB /  81559MiB  |
+-----------------------------------------------------------+
"""


def torch_script(N=40, every=10, hyperparameters=TORCH_HYPERPARAMETERS):
    return TORCH_SCRIPT.format(hyperparameters=hyperparameters.format(N=N, every=every))


# record 89's logs print the script's helper files after it, each under a header of its own
TORCH_89_EXTRA_FILE = ("\n" + "-" * 40 + "\n# triton_kernels.py\n" + "-" * 40 + "\n\nimport triton\n\n\n"
                       "@triton.jit\ndef kernel(x_ptr, n: tl.constexpr\n")  # (a file cut at its end: not Python)


def write_torch_log(path, val_losses, N=40, every=10, step_ms=120.0, compile_ms=17000.0,
                    hyperparameters=TORCH_HYPERPARAMETERS, end="complete", extra_source="", clock_restart=10):
    """A log as the PyTorch speedrun's script writes it: print(code), a rule, versions, nvidia-smi,
    a rule, then step lines whose clock restarts after step 10 (records 18-21: the first steps include
    compilation; clock_restart=None: from record 22 on, compiled in a warm-up before the clock, every
    step timed), val lines every `every` steps and at the end, and the peak memory. end: "complete",
    or where the file is cut off: "source", "environment" or "mid_run" (inside a step line)."""
    script = torch_script(N, every, hyperparameters) + extra_source
    text = (script + "\n" + RULE + "\nRunning Python 3.12.7 (main, Jan 17 2025, 03:57:17) [GCC 13.2.0]\n"
            "Running PyTorch 2.7.0.dev20250110+cu126 compiled for CUDA 12.6\n" + NVIDIA_SMI + "\n" + RULE + "\n")
    ms, val = 0.0, iter(val_losses)
    for step in range(N + 1):
        if step == clock_restart:
            ms = 0.0  # the speedrun's clock restarts here
        if clock_restart is None:  # every step timed: step_avg over all of them
            val_timed = train_timed = None
        else:  # its step_avg is nan until step 12
            timed = None if step <= 11 else step - 10 + 1
            val_timed, train_timed = timed and timed - 1 or 0, timed or 0
        if step == N or step % every == 0:
            text += val_line(step, N, next(val), ms, val_timed) + "\n"
        if step == N:
            break
        ms += step_ms + (compile_ms if step == 0 and clock_restart is not None else 0)
        text += train_line(step + 1, N, ms, train_timed) + "\n"
    text += "peak memory allocated: 37653 MiB reserved: 39236 MiB\n"
    cut = {"complete": len(text), "source": text.index("class Hyperparameters") + 30,
           "environment": text.index("NVIDIA-SMI") + 5, "mid_run": text.index(f"step:{N // 2 + 1}/{N}") + 8}[end]
    with open(path, "x") as f:
        f.write(text[:cut])
    return str(path)
