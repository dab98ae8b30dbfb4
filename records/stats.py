"""Statistics over several runs' record logs (ours, the PyTorch speedrun's, or a mix), the speedrun's
record test, and a two-group comparison of loss and time.

  python records/stats.py LOG... [--target 3.28] [--alpha 0.01] [--skip-incomplete]
                          [--against LOG...] [--plot OUT.png]

A LOG may be a file, a folder (its *.txt files) or a quoted glob ('records/2025-*.txt'). Prints
the number of runs, mean and standard deviation of the final val loss and of the training time,
and the one-sided one-sample t-test of "mean final val loss < target" (a new record must show
p < 0.01): run on a PyTorch record's published logs, it reproduces that record's claim. Then the
runs' std beside record 89's (0.0014) and how many runs the record test needs at the measured mean
and std. --against LOG... adds a second group (e.g. a PyTorch record's logs): Welch's one-sided
two-sample t-test of the final val loss, the paired t-test by seed when both groups share at
least 2 seeds (our runs are deterministic per seed), and Welch's test of the training time when
both groups ran on the same device kind and count and their times can be put on one clock.
--plot draws each run's final loss and time per group, the target and the means with confidence
intervals (matplotlib). The same log given twice counts once. An unfinished run is an error
unless --skip-incomplete, which leaves it out and says so; a run stopped by an error (a
non-finite loss; a PyTorch log whose final val loss is NaN) is a failed run, and no record claim
holds with one. The p-values need scipy, an optional extra (pip install scipy).
"""
import argparse
import collections
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from records.logs import (LAYOUT_NAMES, OURS, PYTORCH, LogError, expand, parse_log, plot_refused,  # noqa: E402
                          require_complete, say, synthetic_shards)

TARGET, ALPHA = 3.28, 0.01  # the speedrun's rule: mean final val loss below 3.28 at p < 0.01
RECORD_RUNS, RECORD_STD = 13, 0.0014  # record 89's published final losses (2026-07-17; their mean: 3.2784)
POWER = 0.8  # "runs needed": the smallest n at which the record test passes with this probability


def probability(text: str) -> float:
    """argparse type of --alpha: a significance level, strictly between 0 and 0.5 (the plot's intervals
    cover 1 - 2 alpha)."""
    try:
        if 0 < float(text) < 0.5:
            return float(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--alpha must be a significance level between 0 and 0.5 (got {text!r}), "
                                     f"e.g. 0.01")


def loss_target(text: str) -> float:
    """argparse type of --target: a finite val loss."""
    try:
        if math.isfinite(float(text)):
            return float(text)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--target must be a finite val loss (got {text!r}), e.g. 3.28")


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


def runs_needed(mean: float, std: float, target: float, alpha: float, most: int = 10_000):
    """The smallest n at which the one-sided one-sample t-test at alpha rejects "mean >= target"
    with probability POWER when the runs' true mean and std are `mean` and `std` (mean < target):
    the statistic then follows a noncentral t with n - 1 degrees of freedom. None beyond `most`."""
    import numpy as np  # scipy's own dependency
    from scipy import stats

    n = np.arange(2, most + 1)
    power = stats.nct.cdf(stats.t.ppf(alpha, n - 1), n - 1, (mean - target) / (std / np.sqrt(n)))
    return int(n[np.argmax(power >= POWER)]) if (power >= POWER).any() else None


def load_runs(paths: list, skip_incomplete: bool, fix: str = "--skip-incomplete leaves unfinished runs out") -> tuple:
    """(finished runs, notes, failed): one run per distinct log; unfinished runs raise LogError (its
    message ends with `fix`), or with skip_incomplete are left out and named in the notes. failed: the
    paths of runs stopped by an error (a non-finite loss...), as opposed to interrupted or cut off."""
    runs, notes, failed, seen = [], [], [], {}
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
            if run.status == "stopped":
                failed.append(path)
        else:
            require_complete(run, fix)
    if not runs:
        raise LogError(f"no finished run among {', '.join(paths)} (--skip-incomplete left them all out)")
    return runs, notes, failed


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


def group_differences(runs: list, against: list) -> str:
    """What differs between the two groups that makes their losses incomparable ('' if nothing): the
    validation shards and preset of our logs (a PyTorch script names its shards by an expression),
    FineWeb or synthetic training data (a changed hyperparameter is what an attempt tests, so those
    may differ)."""
    def kinds(group, of, ours_only):
        return {of(r) for r in group if r.layout == OURS or not ours_only}

    what = []
    for name, of, ours_only in [
            ("val_files", lambda r: os.path.normpath(r.hyperparameters["val_files"]) if "val_files" in
             r.hyperparameters else None, True),
            ("train data", lambda r: "synthetic" if synthetic_shards(r) else "not synthetic", False),
            ("preset", lambda r: r.preset, True)]:
        a, b = kinds(runs, of, ours_only) - {None}, kinds(against, of, ours_only) - {None}
        if a and b and a != b:
            what.append(f"{name} ({', '.join(map(str, sorted(a)))} vs {', '.join(map(str, sorted(b)))})")
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


def claim_problems(runs: list) -> list:
    """Why no record claim can rest on these runs, whatever the t-test says: a seed that ran more than
    once among our logs (the seed draws the initialisation, a run's only randomness: a rerun is no
    independent sample; PyTorch logs name no seed), shards that are data/synthetic.py's."""
    problems, by_seed = [], collections.defaultdict(list)
    for run in runs:
        if run.layout == OURS and isinstance(run.hyperparameters.get("seed"), int):
            by_seed[run.hyperparameters["seed"]].append(run.path)
    for seed, paths in sorted(by_seed.items()):
        if len(paths) > 1:
            problems.append(f"seed {seed} ran {len(paths)} times ({', '.join(paths)}): a rerun of a seed is not an "
                            f"independent sample; give each run its own --seed")
    if fake := [r.path for r in runs if synthetic_shards(r) or synthetic_shards(r, "val_files")]:
        problems.append(f"{len(fake)} run(s) trained or validated on synthetic shards (e.g. {fake[0]}): their losses "
                        f"say nothing about FineWeb")
    return problems


def record_test(losses: list, target: float, alpha: float, failed: list = (), problems: list = ()) -> list:
    """The one-sided t-test of "mean final val loss < target" and the claim it supports; no claim
    holds with failed runs (they have no final loss, and a record counts every run), nor with
    claim_problems."""
    n, p, lines = len(losses), None, []
    if n < 2:
        lines.append("one run: no t-test (it needs at least 2 runs)")
    elif len(set(losses)) == 1:
        lines.append("all final losses are equal, so the t-test is undefined: identical runs (the same --seed on a "
                     "deterministic backend) are one sample, not several; vary --seed")
    else:
        t, p = t_test_less(losses, target)
        lines.append(f"t = {t:.3f} (df {n - 1}); the p-value, and so the record claim, needs scipy: pip install scipy"
                     if p is None else
                     f"one-sided t-test, H1: mean final val loss < {target}: t = {t:.3f}, df = {n - 1}, p = {p:.3g}")
    if failed:
        problems = [f"{len(failed)} run(s) failed ({', '.join(failed)}); a record counts every run, and a failed run "
                    f"has no final loss", *problems]
    if problems:
        lines += [f"record claim does NOT hold: {problem}" for problem in problems]
    elif p is not None and p < alpha:
        lines.append(f"record claim holds at p<{alpha:g}")
    elif p is not None:
        why = ("the mean is not below the target" if statistics.mean(losses) >= target
               else "the mean is below the target, but not significantly: more runs or a lower loss needed")
        lines.append(f"record claim does NOT hold at p<{alpha:g} (p = {p:.3g}): {why}")
    return lines


def spread_lines(losses: list, target: float, alpha: float) -> list:
    """The runs' std beside record 89's, and the runs the record test needs at this mean and std."""
    if len(losses) < 2:
        return []
    mean, std = statistics.mean(losses), statistics.stdev(losses)
    lines = [f"spread: std {std:.4f}; record 89's: {RECORD_STD} over its {RECORD_RUNS} runs"]
    if mean >= target:
        lines.append(f"runs needed: none would do: the mean {mean:.4f} is not below the target {target}")
    elif std > 0:
        try:
            n = runs_needed(mean, std, target, alpha)
        except ImportError:
            return lines + ["runs needed: needs scipy (pip install scipy)"]
        lines.append(f"runs needed: {n or 'more than 10000'} for the record test to pass at p<{alpha:g} with "
                     f"{POWER:.0%} probability, if the runs' true mean and std are {mean:.4f} and {std:.4f}")
    return lines


def claim(head: str, p, alpha: float, shown: str, not_shown: str, why: str) -> list:
    """A two-group test's line (head, then its p-value) and what it shows at alpha."""
    if p is None:
        return [f"{head}; the p-value needs scipy: pip install scipy"]
    return [f"{head}, p = {p:.3g}",
            f"{shown} at p<{alpha:g}" if p < alpha else f"{not_shown} at p<{alpha:g} (p = {p:.3g}): {why}"]


def two_group_test(a: list, b: list, alpha: float, quantity: str = "final val loss") -> list:
    if len(a) < 2 or len(b) < 2:
        return ["Welch's t-test needs at least 2 runs in each group"]
    if len(set(a)) == 1 and len(set(b)) == 1:
        return [f"Welch's t-test is undefined: the {quantity} values within each group are all equal (vary --seed)"]
    t, df, p = welch_less(a, b)
    why = ("their mean is not lower" if statistics.mean(a) >= statistics.mean(b)
           else "their mean is lower, but not significantly: more runs or a larger gap needed")
    return claim(f"Welch's t-test, H1: mean {quantity} of the runs < that of the --against runs: t = {t:.3f}, "
                 f"df = {df:.1f}", p, alpha, f"the runs' mean {quantity} is below the --against runs'",
                 f"the runs' mean {quantity} is NOT shown below the --against runs'", why)


def seeds_of(runs: list, label: str) -> tuple:
    """({seed: run}, '') or (None, why the group cannot be paired by seed)."""
    by_seed = {}
    for run in runs:
        seed = run.hyperparameters.get("seed")
        if not isinstance(seed, int):
            return None, f"{run.path} ({label}) names no seed"
        if seed in by_seed:
            return None, f"seed {seed} appears twice among {label} ({by_seed[seed].path}, {run.path})"
        by_seed[seed] = run
    return by_seed, ""


def paired_test(runs: list, against: list, alpha: float) -> list:
    """Same seed, same initialisation and data order: the paired differences leave out the seed's
    share of the spread, so this test has more power than Welch's when the groups share seeds."""
    a, why = seeds_of(runs, "the runs")
    b, why_against = seeds_of(against, "the --against runs")
    if a is None or b is None:
        return [f"no paired test by seed: {why or why_against}"]
    shared = sorted(a.keys() & b.keys())
    if len(shared) < 2:
        return [f"no paired test by seed: {len(shared)} seed(s) shared by both groups; it needs at least 2"]
    differences = [a[s].final_val_loss - b[s].final_val_loss for s in shared]
    head = (f"paired t-test by seed ({len(shared)} shared seeds), H1: final val loss of the runs < that of the "
            f"--against runs at the same seed")
    if len(set(differences)) == 1:
        return [f"{head}: undefined, every seed's difference is {differences[0]:+.4f}"]
    t, p = t_test_less(differences, 0.0)
    mean = statistics.mean(differences)
    return claim(f"{head}: mean difference {mean:+.4f}, t = {t:.3f}, df = {len(shared) - 1}", p, alpha,
                 "the runs' final val loss is below the --against runs' at the same seed",
                 "the runs' final val loss is NOT shown below the --against runs' at the same seed",
                 "their mean difference is not negative" if mean >= 0 else "more runs or a larger gap needed")


def _device_key(run) -> tuple:
    count, kind = run.devices
    return count, " ".join(kind.split()).lower()


def comparable_times(runs: list, against: list) -> tuple:
    """((times of runs, times of against) in seconds on one clock, the clock's name), or (None, why
    not). Times compare only between runs on the same device kind and count (read from the logs)
    and on one clock: records 18-21 of the PyTorch speedrun leave out their first 10 steps (they
    include compilation, ours happens before the clock), so with such a log in either group ours are
    put on that clock from their step lines: the time at the end minus the time at that step; later
    records time every step after a warm-up that compiled, as ours."""
    everyone = runs + against
    if unknown := next((r for r in everyone if r.devices is None), None):
        return None, f"{unknown.path} does not say which devices ran it"
    first = everyone[0]
    if other := next((r for r in everyone if _device_key(r) != _device_key(first)), None):
        return None, (f"the runs ran on different devices: {first.devices[0]} x {first.devices[1]} ({first.path}), "
                      f"{other.devices[0]} x {other.devices[1]} ({other.path})")
    torch = [r for r in everyone if r.layout == PYTORCH]
    skip, clock = 0, "the JAX clock (every step)"
    if torch:
        skipped = sorted({r.untimed_steps for r in torch})
        if len(skipped) > 1:
            return None, (f"the PyTorch logs' clocks leave out different numbers of first steps ({skipped}: records "
                          f"18-21 restart theirs after step 10, later ones compile before it starts)")
        skip = skipped[0]
        if not skip:  # later records compile in a warm-up before their clock starts, as ours compiles before ours
            clock = "the clock of every step (the PyTorch logs' starts after their warm-up compiled)"
        elif cut := next((r for r in everyone if r.layout == OURS and r.time_at_step(skip) is None), None):
            return None, f"{cut.path} has no step line {skip}, so its time cannot be put on the PyTorch clock"
        else:
            ours = f"; JAX runs: time at the end minus at step {skip}" if len(torch) < len(everyone) else ""
            clock = f"the PyTorch clock (without the first {skip} steps{ours})"

    def seconds(run):
        return (run.train_time_ms - (run.time_at_step(skip) if skip and run.layout == OURS else 0)) / 1000

    return ([seconds(r) for r in runs], [seconds(r) for r in against]), clock


def time_test(runs: list, against: list, alpha: float) -> list:
    times, clock = comparable_times(runs, against)
    if times is None:
        return [f"times not comparable: {clock}; no time test"]
    a, b = times
    return [f"training time on {clock}: runs mean {statistics.mean(a):.2f}s, --against runs mean "
            f"{statistics.mean(b):.2f}s", *two_group_test(a, b, alpha, "training time")]


def plot(groups: list, path: str, target: float, alpha: float):
    """Each run's final val loss and training time as points, a column per group [(label, runs)],
    with the target line and each group's mean and (1 - 2 alpha) confidence interval, whose top is
    below the target exactly when the one-sided test gives p < alpha. Times are on one clock when
    comparable_times finds one, else each on its own (said in the title). Returns the figure.
    matplotlib and scipy are optional extras, imported here."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    from scipy import stats

    runs, against = groups[0][1], (groups[1][1] if len(groups) > 1 else [])
    times, clock = comparable_times(runs, against)
    if times is None:
        times, clock = ([[r.train_time_ms / 1000 for r in g] for _, g in groups], "each log's own clock: not comparable")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    level = 1 - 2 * alpha
    for ax, values_of, title in ((axes[0], [[r.final_val_loss for r in g] for _, g in groups], "final val loss"),
                                 (axes[1], times, f"training time (s), {clock}")):
        for i, ((label, _), values) in enumerate(zip(groups, values_of)):
            n, mean = len(values), statistics.mean(values)
            ax.plot([i - 0.15 + 0.3 * j / max(n - 1, 1) for j in range(n)], values, "o", alpha=0.6,
                    label=f"{label}: {n} run(s)")
            if n > 1:
                half = float(stats.t.ppf(1 - alpha, n - 1)) * statistics.stdev(values) / n**0.5
                ax.plot([i + 0.3] * 2, [mean - half, mean + half], "k-", lw=2, label=f"{label}: {level:.0%} CI")
            ax.plot([i + 0.3], [mean], "ks", label=f"{label}: mean")
        ax.set_xticks(range(len(groups)), [label for label, _ in groups])
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].axhline(target, color="red", ls="--", label=f"target {target}")
    shown = [y for line in axes[0].lines for y in line.get_ydata()]
    pad = max(0.1 * (max(shown) - min(shown)), 5e-4)
    axes[0].set_ylim(min(shown) - pad, max(shown) + pad)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"each run, and each group's mean with its {level:.0%} confidence interval (its top below the "
                 f"target: p < {alpha:g})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", metavar="LOG")
    parser.add_argument("--target", type=loss_target, default=TARGET, help="val loss the mean must be below")
    parser.add_argument("--alpha", type=probability, default=ALPHA, help="significance level of the claims")
    parser.add_argument("--skip-incomplete", action="store_true", help="leave unfinished runs out (and list them)")
    parser.add_argument("--against", nargs="+", metavar="LOG", help="a second group of logs: Welch's t-tests of "
                        "'the runs' mean final val loss (training time) is below this group's', and the paired "
                        "test by seed")
    parser.add_argument("--plot", metavar="OUT.png", help="draw each run's final loss and time per group")
    args = parser.parse_args(argv)
    if args.plot and plot_refused(parser, args.plot, ("matplotlib", "scipy")):  # before any work
        return 2
    try:
        runs, notes, failed = load_runs(expand(args.logs, "LOG"), args.skip_incomplete)
        against, against_notes, _ = (load_runs(expand(args.against, "--against"), args.skip_incomplete)
                                     if args.against else ([], [], []))
        both = {r.digest for r in runs} & {r.digest for r in against}
        if both:
            path = next(r.path for r in against if r.digest in both)
            raise LogError(f"{path} is both among the runs and in --against: a group cannot be tested against itself")
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:  # first, so that a missing matplotlib fails before the report
        try:
            plot([("runs", runs)] + ([("--against", against)] if against else []), args.plot, args.target, args.alpha)
        except ImportError as e:
            print(f"error: --plot needs matplotlib and scipy, optional extras ({e}): pip install matplotlib scipy",
                  file=sys.stderr)
            return 2
    losses = [r.final_val_loss for r in runs]
    lines = (notes + describe("runs", runs) + record_test(losses, args.target, args.alpha, failed, claim_problems(runs))
             + spread_lines(losses, args.target, args.alpha))
    if against:
        if differences := group_differences(runs, against):
            against_notes.append(f"note: the two groups differ in {differences}: their losses are not comparable")
        lines += ["", *against_notes, *describe("--against runs", against),
                  *two_group_test(losses, [r.final_val_loss for r in against], args.alpha),
                  *paired_test(runs, against, args.alpha), *time_test(runs, against, args.alpha)]
    if args.plot:
        lines.append(f"plot written to {args.plot}")
    say("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
