"""Compare two record logs, ours (train_gpt.py) or the PyTorch speedrun's, in any pairing: what
changed (source, hyperparameters), the validation curves, and final loss, time and memory.

  python records/compare.py A.txt B.txt [--plot out.png] [--baseline record89] [--target 3.28] [--allow-incomplete]

Sources are diffed only between logs of the same language. Between a JAX and a PyTorch log, the
hyperparameters of the same meaning are shown side by side (SAME_MEANING maps the names). Curves
are shown at common steps and, when the step counts differ, at common fractions of training.
--plot draws val loss against step, fraction of training and training time, and below them the
range that decides a record: the end of training, on a loss axis that spans the target line and
the final losses (at least 0.3 nats; more only when they lie further apart), needs matplotlib, an
optional extra; --baseline record89 (or record20) adds a published PyTorch curve (records/record89_curve.tsv:
the mean of record 89's 13 logs; records/record20_curve.tsv: one record-20 log).
Logs of unfinished runs are rejected unless --allow-incomplete (their partial curves are shown).
"""
import argparse
import difflib
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from records.logs import (LAYOUT_NAMES, OURS, PYTORCH, LogError, parse_log, plot_refused,  # noqa: E402
                          require_complete, say, synthetic_shards)
from records.stats import TARGET, loss_target  # noqa: E402

BASELINES = {name: os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}_curve.tsv")
             for name in ("record20", "record89")}


def load_baseline(name: str) -> list:
    """[(step, val_loss, train_time_ms)] of a published curve."""
    with open(BASELINES[name]) as f:
        rows = [line.split("\t") for line in f if line.strip() and not line.startswith(("#", "step"))]
    return [(int(s), float(v), float(t)) for s, v, t in rows]


# Our hyperparameter (train_gpt.py's, or the record-20 archive's) -> the PyTorch scripts' names for the
# same quantity (records 18-22 say seq_len, later ones train_seq_len); checked against their
# Hyperparameters dataclasses (records 20 and 89).
SAME_MEANING = {
    "train_files": ("train_files",),
    "val_files": ("val_files",),
    "val_tokens": ("val_tokens",),
    "val_batch_size": ("val_batch_size",),
    "batch_size": ("batch_size",),  # record 20: tokens per optimizer step, all devices together
    "seq_len": ("seq_len", "train_seq_len"),  # record 20: tokens per training sequence: one GPU's share
    "num_iterations": ("num_iterations",),  # record 20
    "num_scheduled_iterations": ("num_scheduled_iterations",),  # record 89: the schedule's steps ...
    "num_extension_iterations": ("num_extension_iterations",),  # ... then these at the final lr
    "bigram_vocab_size": ("bigram_vocab_size",),
    "bigram_sign_rows": ("bigram_sign_table_rows",),
    "cooldown_frac": ("cooldown_frac",),
    "val_loss_every": ("val_loss_every",),
    "vocab_size": ("vocab_size",),
    "num_layers": ("num_layers",),
    "num_heads": ("num_heads",),
    "model_dim": ("model_dim",),
}


class _Absent:
    def __repr__(self):
        return "(absent)"


ABSENT = _Absent()  # a hyperparameter the script does not name


def source_diff(a, b) -> list:
    if a.layout != b.layout:
        return [f"not diffed: A is a {LAYOUT_NAMES[a.layout]}, B a {LAYOUT_NAMES[b.layout]} (different languages)"]
    diff = list(difflib.unified_diff(a.source.splitlines(), b.source.splitlines(), a.path, b.path, lineterm=""))
    return diff or ["sources identical"]


def hyperparameter_changes(a, b) -> list:
    """Same layout: every hyperparameter whose value differs, by its name in the logs."""
    keys = list(a.hyperparameters) + [k for k in b.hyperparameters if k not in a.hyperparameters]
    changes = [f"{k}: {a.hyperparameters.get(k, ABSENT)!r} -> {b.hyperparameters.get(k, ABSENT)!r}"
               for k in keys if a.hyperparameters.get(k, ABSENT) != b.hyperparameters.get(k, ABSENT)]
    if a.preset != b.preset:
        changes.insert(0, f"preset: {a.preset} -> {b.preset}")
    return changes or ["hyperparameters identical"]


def hyperparameter_pairs(a, b) -> list:
    """One JAX and one PyTorch log: the hyperparameters of the same meaning (SAME_MEANING), side by
    side, absent where a script does not name one; then the names that have no counterpart."""
    ours, theirs = (a, b) if a.layout == OURS else (b, a)
    rows, mapped = [], set()
    for name, torch_names in SAME_MEANING.items():
        torch_name = next((n for n in torch_names if n in theirs.hyperparameters), None)
        mapped.add(torch_name)
        mine, other = ours.hyperparameters.get(name, ABSENT), theirs.hyperparameters.get(torch_name, ABSENT)
        x, y = (mine, other) if a is ours else (other, mine)
        label = name if torch_name in (None, name) else f"{name} (PyTorch: {torch_name})"
        differs = x is not ABSENT and y is not ABSENT and x != y
        rows.append(f"{label}: A {x!r}, B {y!r}" + ("  <- differs" if differs else ""))
    for label, run, names in (("A", a, SAME_MEANING if a is ours else mapped),
                              ("B", b, SAME_MEANING if b is ours else mapped)):
        if rest := [k for k in run.hyperparameters if k not in names]:
            rows.append(f"only in {label} (no counterpart): {', '.join(rest)}")
    return rows


def interpolate(curve: list, x: float):
    """Val loss at step x, linear between the logged val steps; None outside them."""
    points = [(s, v) for s, v, _ in curve]
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= x <= s1:
            return v0 + (v1 - v0) * (x - s0) / (s1 - s0) if s1 > s0 else v0
    return points[0][1] if len(points) == 1 and points[0][0] == x else None


def curve_table(a, b, baseline=None, baseline_name="") -> list:
    va, vb = {s: v for s, v, _ in a.val_curve}, {s: v for s, v, _ in b.val_curve}
    base = {s: v for s, v, _ in baseline} if baseline else {}
    header = f"{'step':>6} {'A':>8} {'B':>8} {'B-A':>8}" + (f" {baseline_name:>9}" if baseline else "")
    rows = [header]
    for s in sorted(set(va) & set(vb)):
        row = f"{s:>6} {va[s]:>8.4f} {vb[s]:>8.4f} {vb[s] - va[s]:>+8.4f}"
        if baseline:
            row += f" {base[s]:>9.4f}" if s in base else f" {'':>9}"
        rows.append(row.rstrip())
    if len(rows) == 1:
        return ["no common validation steps"]
    if baseline and not base.keys() & set(va) & set(vb):  # an empty column would look like a bug
        steps = sorted(base)
        rows.append(f"({baseline_name} has no value at these steps: its curve is at steps {steps[0]}, {steps[1]}, "
                    f"..., {steps[-1]}; --plot draws it)")
    return rows


def fraction_table(a, b) -> list:
    """Runs of different lengths: val loss at 0%, 10%, ..., 100% of each run's steps."""
    na, nb = a.num_iterations, b.num_iterations
    rows = [f"{'frac':>5} {'A step':>7} {'A':>8} {'B step':>7} {'B':>8} {'B-A':>8}"]
    for i in range(11):
        x, y = interpolate(a.val_curve, i / 10 * na), interpolate(b.val_curve, i / 10 * nb)
        if x is not None and y is not None:
            rows.append(f"{i / 10:>5.1f} {i / 10 * na:>7.0f} {x:>8.4f} {i / 10 * nb:>7.0f} {y:>8.4f} {y - x:>+8.4f}")
    return rows if len(rows) > 1 else ["no common fractions of training"]


def _shown(x, spec: str) -> str:
    return f"{'n/a':>10}" if x is None or x != x else f"{x:10{spec}}"


def timing_lines(a, b) -> list:
    """Final loss, times and memory side by side (n/a where a log does not say); an unfinished
    run's time is what its last step line shows, so that partial runs compare too."""
    def final(run):
        return run.final_val_loss if run.finished else None

    lines = []
    for label, get, spec, ratio in (("final_val_loss", final, ".4f", False),
                                    ("train_time (ms)", lambda r: r.train_time_ms, ".2f", True),
                                    ("step_avg (ms)", lambda r: r.step_avg_ms, ".2f", True),
                                    ("timed steps", lambda r: r.timed_steps, "d", False),
                                    ("tokens_per_s", lambda r: r.tokens_per_s, ".0f", False),
                                    ("compile_s", lambda r: r.compile_s, ".1f", False),
                                    ("peak_memory (MiB)", lambda r: r.peak_memory_mib, ".0f", False)):
        x, y = get(a), get(b)
        line = f"{label:<17} A {_shown(x, spec)}   B {_shown(y, spec)}"
        if x is not None and y is not None and x == x and y == y:
            line += f"   B-A {y - x:+10{spec}}" + (f" ({(y - x) / x:+.1%})" if ratio and x else "")
        lines.append(line)
    for label, run in (("A", a), ("B", b)):
        if run.layout == PYTORCH and run.untimed_steps:
            lines.append(f"clock of {label} (PyTorch): excludes validation and its first {run.untimed_steps} steps, "
                         f"which include compilation")
        elif run.layout == PYTORCH:
            lines.append(f"clock of {label} (PyTorch): excludes validation; covers every step, compilation "
                         f"happens in a warm-up before it")
        elif PYTORCH in (a.layout, b.layout):
            lines.append(f"clock of {label} (JAX): excludes validation; covers every step, compilation "
                         f"happens before it (compile_s)")
    return lines


def stage_lines(a, b) -> list:
    """Step time by stage (RunLog.stage_step_ms) side by side: the stages' pace without the steps that
    carry a program's first run or a validation; [] when neither log says its stages (PyTorch's)."""
    rows = {label: run.stage_step_ms() for label, run in (("A", a), ("B", b))}
    lines = []
    for k in range(max(map(len, rows.values()))):
        cells, ms = [], {}
        for label in ("A", "B"):
            row = rows[label][k] if k < len(rows[label]) else None
            ms[label] = row and row["ms"]
            n = len(row["steps"]) if ms[label] else 0
            cells.append(f"{label} " + (f"{row['ms']:10.2f} ms {row['tokens_per_s']:9.0f} tokens/s ({n} step"
                                        f"{'s' * (n > 1)})" if n else f"{'n/a':>10}{' (no step of its pace)':<32}"))
        line = f"stage {k:<11} " + "   ".join(cells)
        if ms["A"] and ms["B"]:
            line += f"   B-A {ms['B'] - ms['A']:+.2f} ms ({(ms['B'] - ms['A']) / ms['A']:+.1%})"
        lines.append(line.rstrip())
    return lines


def decisive_range(finals: list, target: float, least: float = 0.3) -> tuple:
    """(bottom, top) of a loss axis that shows what decides a record: the target and the final
    losses, with room above them for the curves' approach. It spans `least` nats, or 1.25 times
    the spread of target and finals when they lie further apart (a run far from the target)."""
    lo, hi = min(finals + [target]), max(finals + [target])
    span = max(least, 1.25 * (hi - lo))
    bottom = lo - 0.1 * (span - (hi - lo))
    return bottom, bottom + span


def plot(a, b, path: str, baseline=None, baseline_name="", target: float = TARGET):
    """Val loss against step, fraction of training and training time (the whole curves, top row),
    and below them the decisive range (decisive_range) against fraction of training, with the
    target line and the final losses (also in the legend); returns the figure.
    matplotlib is an optional extra, imported here so that the text comparison works without it."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(16, 10))
    grid = fig.add_gridspec(2, 3, height_ratios=(1, 1.4))
    axes = [fig.add_subplot(grid[0, i]) for i in range(3)]
    decisive = fig.add_subplot(grid[1, :])

    def kind(r):  # the language, and for ours the preset and whether the shards are synthetic
        if r.layout == PYTORCH:
            return "PyTorch"
        return f"JAX, preset {r.preset}" + (", synthetic shards" if synthetic_shards(r) else "")

    # a diverged PyTorch run's NaN losses (--allow-incomplete) are no points to draw
    curves = [(f"{label}: {os.path.basename(r.path)} ({kind(r)})", [p for p in r.val_curve if math.isfinite(p[1])],
               r.num_iterations) for label, r in (("A", a), ("B", b))]
    if baseline:
        curves.append((f"{baseline_name} (PyTorch, 8xH100)", baseline, baseline[-1][0]))
    bottom, top = decisive_range([curve[-1][1] for _, curve, _ in curves if curve], target)
    start = 1.0  # the decisive panel starts where the last curve enters it from above
    for label, curve, steps in curves:
        losses, fractions = [v for _, v, _ in curve], [s / steps for s, _, _ in curve]
        for ax, xs in zip(axes, ([s for s, _, _ in curve], fractions, [t / 1000 for _, _, t in curve])):
            ax.plot(xs, losses, marker=".", label=label)
        if curve:  # an unfinished run (--allow-incomplete) may have no val line yet
            decisive.plot(fractions, losses, marker=".", label=f"{label}: last {losses[-1]:.4f}")
            start = min(start, max([f for f, v in zip(fractions, losses) if v > top], default=0.0))
    for ax, xlabel in zip(axes, ("step", "fraction of training", "training time (s)")):
        ax.set_title(f"val loss vs {xlabel}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
    # the curves' legend above the top row, outside its panels: inside one it covered a short run's curve
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(curves), fontsize=8)
    decisive.axhline(target, color="red", ls="--", label=f"target {target}")
    decisive.set_ylim(bottom, top)
    decisive.set_xlim(start, 1.01)
    decisive.set_title(f"the decisive range: {top - bottom:.2f} nats holding the target and the last val losses")
    decisive.set_xlabel("fraction of training")
    decisive.set_ylabel("val loss")
    decisive.grid(alpha=0.3)
    decisive.legend(fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=100)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--plot", metavar="OUT.png")
    parser.add_argument("--baseline", choices=sorted(BASELINES))
    parser.add_argument("--target", type=loss_target, default=TARGET, help="the target line of --plot's decisive panel")
    parser.add_argument("--allow-incomplete", action="store_true", help="show unfinished runs' partial curves")
    args = parser.parse_args(argv)
    for path in (args.a, args.b):
        if not os.path.exists(path) and any(c in path for c in "*?["):
            parser.error(f"{path} is a pattern: compare.py takes two log files, A and B (records/stats.py takes "
                         f"groups of logs, folders and patterns)")
    if args.plot and plot_refused(parser, args.plot, ("matplotlib",)):  # before any work
        return 2
    try:
        a, b = parse_log(args.a), parse_log(args.b)
        if not args.allow_incomplete:
            for run in (a, b):
                require_complete(run, "--allow-incomplete shows its partial curve")
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    baseline = load_baseline(args.baseline) if args.baseline else None
    if args.plot:
        plot(a, b, args.plot, baseline, args.baseline, args.target)
    for label, run in (("A", a), ("B", b)):
        partial = "" if run.finished else f" -- {run.status} at step {run.last_step}: partial curve"
        say(f"{label}: {run.path} ({run.describe()}){partial}")
    if a.digest == b.digest:
        say("note: A and B are the same log")
    say()
    sections = [("source", source_diff(a, b)),
                ("hyperparameters", hyperparameter_changes(a, b) if a.layout == b.layout
                 else hyperparameter_pairs(a, b)),
                ("validation loss at common steps", curve_table(a, b, baseline, args.baseline))]
    if a.num_iterations != b.num_iterations:
        sections.append((f"validation loss at common fractions of training (A {a.num_iterations} steps, "
                         f"B {b.num_iterations}; linear between logged val steps)", fraction_table(a, b)))
    sections.append(("timing", timing_lines(a, b)))
    if a.stage_starts or b.stage_starts:
        sections.append(("step time by stage (without each stage's first and last step and the steps at and "
                         "after a validation)", stage_lines(a, b)))
    for title, lines in sections:
        say(f"== {title}")
        say("\n".join(lines) + "\n")
    if args.plot:
        say(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
