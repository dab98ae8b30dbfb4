"""Compare two record logs: what changed (source, hyperparameters), the validation curves at common
steps, and the timing.

  python records/compare.py A.txt B.txt [--plot out.png] [--baseline record20] [--allow-incomplete]

--plot draws val loss against step and against training time for both runs (needs matplotlib, an
optional extra); --baseline record20 adds the published PyTorch record-20 curve (records/record20_curve.tsv).
Logs of unfinished runs are rejected unless --allow-incomplete (their partial curves are shown).
"""
import argparse
import difflib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from records.logs import LogError, parse_log, require_complete  # noqa: E402

BASELINES = {"record20": os.path.join(os.path.dirname(os.path.abspath(__file__)), "record20_curve.tsv")}


def load_baseline(name: str) -> list:
    """[(step, val_loss, train_time_ms)] of a published curve."""
    with open(BASELINES[name]) as f:
        rows = [line.split("\t") for line in f if line.strip() and not line.startswith(("#", "step"))]
    return [(int(s), float(v), float(t)) for s, v, t in rows]


def source_diff(a, b) -> list:
    diff = list(difflib.unified_diff(a.source.splitlines(), b.source.splitlines(), a.path, b.path, lineterm=""))
    return diff or ["sources identical"]


def hyperparameter_changes(a, b) -> list:
    keys = list(a.hyperparameters) + [k for k in b.hyperparameters if k not in a.hyperparameters]
    changes = [f"{k}: {a.hyperparameters.get(k, '(absent)')!r} -> {b.hyperparameters.get(k, '(absent)')!r}"
               for k in keys if a.hyperparameters.get(k) != b.hyperparameters.get(k)]
    if a.preset != b.preset:
        changes.insert(0, f"preset: {a.preset} -> {b.preset}")
    return changes or ["hyperparameters identical"]


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
    return rows if len(rows) > 1 else ["no common validation steps"]


def timing_lines(a, b) -> list:
    """Step and total time from the last training-step line, so that partial runs compare too."""
    def last(run, i):
        return run.train_steps[-1][i] if run.train_steps else float("nan")

    lines = []
    for label, i in (("step_avg (ms)", 2), ("train_time (ms)", 1)):
        x, y = last(a, i), last(b, i)
        ratio = f" ({(y - x) / x:+.1%})" if x else ""
        lines.append(f"{label:<16} A {x:10.2f}   B {y:10.2f}   B-A {y - x:+10.2f}{ratio}")
    for key, f in (("final_val_loss", ".4f"), ("tokens_per_s", ".0f"), ("compile_s", ".1f")):
        if a.summary and b.summary:
            x, y = a.summary[key], b.summary[key]
            lines.append(f"{key:<16} A {x:10{f}}   B {y:10{f}}   B-A {y - x:+10{f}}")
    return lines


def plot(a, b, path: str, baseline=None, baseline_name=""):
    """Val loss against step and against training time; returns the figure. matplotlib is an
    optional extra, imported here so that the text comparison works without it."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    curves = [(f"A: {os.path.basename(a.path)}", a.val_curve), (f"B: {os.path.basename(b.path)}", b.val_curve)]
    if baseline:
        curves.append((f"{baseline_name} (PyTorch, 8xH100)", baseline))
    for label, curve in curves:
        by_step.plot([s for s, _, _ in curve], [v for _, v, _ in curve], marker=".", label=label)
        by_time.plot([t / 1000 for _, _, t in curve], [v for _, v, _ in curve], marker=".", label=label)
    for ax, xlabel in ((by_step, "step"), (by_time, "training time (s)")):
        ax.set_title(f"val loss vs {xlabel}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--plot", metavar="OUT.png")
    parser.add_argument("--baseline", choices=sorted(BASELINES))
    parser.add_argument("--allow-incomplete", action="store_true", help="show unfinished runs' partial curves")
    args = parser.parse_args(argv)
    try:
        a, b = parse_log(args.a), parse_log(args.b)
        if not args.allow_incomplete:
            for run in (a, b):
                require_complete(run)
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    baseline = load_baseline(args.baseline) if args.baseline else None
    if args.plot:  # first, so that a missing matplotlib fails before the report
        try:
            plot(a, b, args.plot, baseline, args.baseline)
        except ImportError as e:
            print(f"error: --plot needs matplotlib, an optional extra ({e}): pip install matplotlib", file=sys.stderr)
            return 2
    for label, run in (("A", a), ("B", b)):
        partial = "" if run.status == "complete" else f" -- {run.status} at step {run.last_step}: partial curve"
        print(f"{label}: {run.path} (preset {run.preset}, {run.hyperparameters.get('num_iterations')} steps){partial}")
    print()
    for title, lines in (("source (train_gpt.py)", source_diff(a, b)),
                         ("hyperparameters", hyperparameter_changes(a, b)),
                         ("validation loss", curve_table(a, b, baseline, args.baseline)),
                         ("timing", timing_lines(a, b))):
        print(f"== {title}")
        print("\n".join(lines) + "\n")
    if args.plot:
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
