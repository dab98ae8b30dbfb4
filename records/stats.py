"""Statistics over several runs' record logs (ours, the PyTorch speedrun's, or a mix), the speedrun's
record test, and a two-group comparison.

  python records/stats.py LOG... [--target 3.28] [--alpha 0.01] [--skip-incomplete] [--against LOG...]

Prints the number of runs, mean and standard deviation of the final val loss and of the training
time, and the one-sided one-sample t-test of "mean final val loss < target" (a new record must
show p < 0.01): run on a PyTorch record's published logs, it reproduces that record's claim.
--against LOG... adds a second group (e.g. a PyTorch record's logs) and Welch's two-sample t-test
of "the runs' mean final val loss < the --against runs' mean". The same log given twice counts
once. An unfinished run is an error unless --skip-incomplete, which leaves it out and says so.
The p-values need scipy, an optional extra (pip install scipy).
"""
import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from records.logs import LAYOUT_NAMES, LogError, parse_log, require_complete  # noqa: E402


def t_test_less(values: list, target: float):
    """(t, p) of the one-sided one-sample t-test with H1: mean < target; p is None without scipy,
    an optional extra (the t statistic alone already says which way the evidence points)."""
    n = len(values)
    try:
        from scipy import stats
    except ImportError:
        return (statistics.mean(values) - target) / (statistics.stdev(values) / n**0.5), None
    result = stats.ttest_1samp(values, target, alternative="less")
    return float(result.statistic), float(result.pvalue)


def welch_less(a: list, b: list):
    """(t, df, p) of Welch's one-sided two-sample t-test with H1: mean(a) < mean(b) (unequal
    variances, Welch-Satterthwaite degrees of freedom); p is None without scipy."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    t = (statistics.mean(a) - statistics.mean(b)) / (va + vb) ** 0.5
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    try:
        from scipy import stats
    except ImportError:
        return t, df, None
    return t, df, float(stats.ttest_ind(a, b, equal_var=False, alternative="less").pvalue)


def load_runs(paths: list, skip_incomplete: bool) -> tuple:
    """(finished runs, notes): one run per distinct log; unfinished runs raise LogError, or with
    skip_incomplete are left out and named in the notes."""
    runs, notes, seen = [], [], {}
    for path in paths:
        run = parse_log(path)
        if run.digest in seen:
            notes.append(f"note: {path} is the same log as {seen[run.digest]}: counted once")
            continue
        seen[run.digest] = path
        if run.finished:
            runs.append(run)
        elif skip_incomplete:
            notes.append(f"skipped {path}: the run did not finish ({run.status} at step "
                         f"{run.last_step}/{run.num_iterations or '?'})")
        else:
            try:
                require_complete(run)
            except LogError as e:
                raise LogError(f"{e} (--skip-incomplete leaves unfinished runs out)") from None
    if not runs:
        raise LogError(f"no finished run among {', '.join(paths)} (--skip-incomplete left them all out)")
    return runs, notes


def configuration_differences(runs: list) -> str:
    """What, besides the seed and where files go, differs between the runs ('' if nothing): a
    record claim pools runs of one configuration, and a glob like records/*.txt easily mixes in old ones."""
    layouts = collections.Counter(r.layout for r in runs)
    if len(layouts) > 1:
        return "language (" + ", ".join(f"{n} {LAYOUT_NAMES[k]}s" for k, n in sorted(layouts.items())) + ")"
    free = {"seed", "records_dir", "compile_cache_dir"}
    first = runs[0].hyperparameters
    keys = sorted(k for k in set().union(*(r.hyperparameters for r in runs)) - free
                  if any(r.hyperparameters.get(k) != first.get(k) for r in runs))
    what = ["source"] if len({r.source for r in runs}) > 1 else []
    if keys:
        what.append(f"hyperparameters ({', '.join(keys)})")
    return ", ".join(what)


def describe(label: str, runs: list) -> list:
    losses = [r.final_val_loss for r in runs]
    times = [r.train_time_ms / 1000 for r in runs]
    n = len(runs)
    kinds = ", ".join(f"{count} {LAYOUT_NAMES[k]}{'s' if count > 1 else ''}"
                      for k, count in sorted(collections.Counter(r.layout for r in runs).items()))

    def spread(values, digits, unit=""):  # a sample standard deviation needs 2 values
        return f"  std {statistics.stdev(values):.{digits}f}{unit}" if n > 1 else ""

    lines = [f"{label}: {n} ({kinds})",
             f"final val loss: mean {statistics.mean(losses):.4f}{spread(losses, 4)}  "
             f"min {min(losses):.4f}  max {max(losses):.4f}",
             f"training time:  mean {statistics.mean(times):.2f}s{spread(times, 2, 's')}"]
    if differences := configuration_differences(runs):
        lines.append(f"note: the runs differ in {differences}; a record claim should test runs of one configuration")
    return lines


def record_test(losses: list, target: float, alpha: float) -> list:
    n = len(losses)
    if n < 2:
        return ["one run: no t-test (it needs at least 2 runs)"]
    if len(set(losses)) == 1:
        return ["all final losses are equal, so the t-test is undefined: identical runs (the same --seed on a "
                "deterministic backend) are one sample, not several; vary --seed"]
    t, p = t_test_less(losses, target)
    if p is None:
        return [f"t = {t:.3f} (df {n - 1}); the p-value, and so the record claim, needs scipy: pip install scipy"]
    lines = [f"one-sided t-test, H1: mean final val loss < {target}: t = {t:.3f}, df = {n - 1}, p = {p:.3g}"]
    if p < alpha:
        lines.append(f"record claim holds at p<{alpha:g}")
    else:
        why = ("the mean is not below the target" if statistics.mean(losses) >= target
               else "the mean is below the target, but not significantly: more runs or a lower loss needed")
        lines.append(f"record claim does NOT hold at p<{alpha:g} (p = {p:.3g}): {why}")
    return lines


def two_group_test(a: list, b: list, alpha: float) -> list:
    if len(a) < 2 or len(b) < 2:
        return ["Welch's t-test needs at least 2 runs in each group"]
    if len(set(a)) == 1 and len(set(b)) == 1:
        return ["Welch's t-test is undefined: the final losses within each group are all equal (vary --seed)"]
    t, df, p = welch_less(a, b)
    head = (f"Welch's t-test, H1: mean final val loss of the runs < that of the --against runs: "
            f"t = {t:.3f}, df = {df:.1f}")
    if p is None:
        return [f"{head}; the p-value needs scipy: pip install scipy"]
    lines = [f"{head}, p = {p:.3g}"]
    if p < alpha:
        lines.append(f"the runs' mean final val loss is below the --against runs' at p<{alpha:g}")
    else:
        why = ("their mean is not lower" if statistics.mean(a) >= statistics.mean(b)
               else "their mean is lower, but not significantly: more runs or a larger gap needed")
        lines.append(f"the runs' mean final val loss is NOT shown below the --against runs' at p<{alpha:g} "
                     f"(p = {p:.3g}): {why}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--target", type=float, default=3.28, help="val loss the mean must be below")
    parser.add_argument("--alpha", type=float, default=0.01, help="significance level of the claims")
    parser.add_argument("--skip-incomplete", action="store_true", help="leave unfinished runs out (and list them)")
    parser.add_argument("--against", nargs="+", metavar="LOG", help="a second group of logs: Welch's t-test of "
                        "'the runs' mean final val loss is below this group's'")
    args = parser.parse_args(argv)
    try:
        runs, notes = load_runs(args.logs, args.skip_incomplete)
        against, against_notes = load_runs(args.against, args.skip_incomplete) if args.against else ([], [])
        both = {r.digest for r in runs} & {r.digest for r in against}
        if both:
            path = next(r.path for r in against if r.digest in both)
            raise LogError(f"{path} is both among the runs and in --against: a group cannot be tested against itself")
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    losses = [r.final_val_loss for r in runs]
    lines = notes + describe("runs", runs) + record_test(losses, args.target, args.alpha)
    if against:
        lines += ["", *against_notes, *describe("--against runs", against),
                  *two_group_test(losses, [r.final_val_loss for r in against], args.alpha)]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
