"""Statistics over several runs' record logs, and the speedrun's record test.

  python records/stats.py LOG... [--target 3.28] [--alpha 0.01]

Prints the number of runs, mean and standard deviation of the final val loss and of the training
time, and the one-sided one-sample t-test of "mean final val loss < target" (a new record must
show p < 0.01). The p-value needs scipy, an optional extra (pip install scipy).
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from records.logs import LogError, parse_log, require_complete  # noqa: E402


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


def configuration_differences(runs: list) -> str:
    """What, besides the seed and where files go, differs between the runs ('' if nothing): a
    record claim pools runs of one configuration, and a glob like records/*.txt easily mixes in old ones."""
    free = {"seed", "records_dir", "compile_cache_dir"}
    first = runs[0].hyperparameters
    keys = sorted(k for k in set().union(*(r.hyperparameters for r in runs)) - free
                  if any(r.hyperparameters.get(k) != first.get(k) for r in runs))
    what = ["train_gpt.py source"] if len({r.source for r in runs}) > 1 else []
    if keys:
        what.append(f"hyperparameters ({', '.join(keys)})")
    return ", ".join(what)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+")
    parser.add_argument("--target", type=float, default=3.28, help="val loss the mean must be below")
    parser.add_argument("--alpha", type=float, default=0.01, help="significance level of the record claim")
    args = parser.parse_args(argv)
    try:
        runs = [require_complete(parse_log(path)) for path in args.logs]
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    losses = [r.final_val_loss for r in runs]
    times = [r.train_time_ms / 1000 for r in runs]
    n = len(runs)

    def spread(values, digits, unit=""):  # a sample standard deviation needs 2 values
        return f"  std {statistics.stdev(values):.{digits}f}{unit}" if n > 1 else ""

    print(f"runs: {n}")
    print(f"final val loss: mean {statistics.mean(losses):.4f}{spread(losses, 4)}  "
          f"min {min(losses):.4f}  max {max(losses):.4f}")
    print(f"training time:  mean {statistics.mean(times):.2f}s{spread(times, 2, 's')}")
    if differences := configuration_differences(runs):
        print(f"note: the runs differ in {differences}; a record claim should test runs of one configuration")
    if n < 2:
        print("one run: no t-test (it needs at least 2 runs)")
        return 0
    if len(set(losses)) == 1:
        print("all final losses are equal, so the t-test is undefined: identical runs (the same --seed on a "
              "deterministic backend) are one sample, not several; vary --seed")
        return 0
    t, p = t_test_less(losses, args.target)
    if p is None:
        print(f"t = {t:.3f} (df {n - 1}); the p-value, and so the record claim, needs scipy: pip install scipy")
        return 0
    print(f"one-sided t-test, H1: mean final val loss < {args.target}: t = {t:.3f}, df = {n - 1}, p = {p:.3g}")
    if p < args.alpha:
        print(f"record claim holds at p<{args.alpha:g}")
    else:
        why = ("the mean is not below the target" if statistics.mean(losses) >= args.target
               else "the mean is below the target, but not significantly: more runs or a lower loss needed")
        print(f"record claim does NOT hold at p<{args.alpha:g} (p = {p:.3g}): {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
