"""A record attempt in one command: N seeded runs of train_gpt.py (or of your copy of it), one
after another, then records/stats.py's verdict over exactly those runs' logs.

  ./run.sh --runs N [--seed S] [--script PATH] [--against LOG|FOLDER|GLOB...] [--target 3.28]
           [--alpha 0.01] [--plot OUT.png] [train_gpt.py options]
  python records/attempt.py --runs N ...   (the same without run.sh's set-up and data flags)

Run i gets --seed S+i-1, S given or drawn at random (and printed, so that the attempt can be
repeated); every other option goes to the script unchanged (--records-dir says where the logs go).
Each run's log is the path the script prints on a line `record log: PATH` (train_gpt.py does as
soon as it opens its log). After each run, a tally: runs done and failed, mean final val loss so
far, ETA.
The verdict is records/stats.py over the attempt's logs, with --against, --target, --alpha and
--plot passed to it; it is printed and saved beside the logs as attempt_<UTC time>_<id>.verdict,
with the stats.py command that reproduces it.

A run's exit code decides what happens next:
  0        finished;
  2        bad flags or data: the attempt stops at once (every run would fail the same way);
  130/143  interrupted (Ctrl-C reaches the run as well, which closes its log first): the attempt
           stops, and the verdict covers the finished runs, marked partial;
  other    failed (1: a non-finite loss, or a crash): named and counted; no record claim holds.
Exit code: 0 every run finished, 1 a run failed, 2 bad options or a run exited 2, 130 (143 for
SIGTERM) interrupted.
"""
import argparse
import contextlib
import importlib.util
import io
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from records import stats  # noqa: E402
from records.logs import LogError, expand, parse_log, plot_path_problem, say  # noqa: E402

TRAIN_GPT = os.path.join(os.path.dirname(HERE), "train_gpt.py")
LOG_LINE = re.compile(r"^record log: (.+)$")  # what train() prints once its log is open
INTERRUPTED = {128 + signal.SIGINT: signal.SIGINT, 128 + signal.SIGTERM: signal.SIGTERM}  # 130, 143
PLOT_EXTRAS = ("matplotlib", "scipy")  # what stats.py --plot imports (not in requirements.txt)


def run_count(text: str) -> int:
    """argparse type of --runs."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--runs must be a whole number of runs, at least 1 (got {text!r}); "
                                         f"for example --runs 3 (a record claim needs more: 11 at record 89's mean "
                                         f"and std)")
    return int(text)


def parse_args(argv):
    """(the attempt's options, the script's options). Only the attempt's own flags are taken out;
    abbreviations are not accepted, so that a script flag is never mistaken for one of them."""
    parser = argparse.ArgumentParser(prog="records/attempt.py", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=run_count, required=True, metavar="N", help="how many runs")
    parser.add_argument("--seed", type=int, help="seed of run 1; run i gets S+i-1 (default: random, printed)")
    parser.add_argument("--script", default=TRAIN_GPT, help="the training script to run (default: train_gpt.py "
                        "beside records/; an attempt usually runs a changed copy)")
    parser.add_argument("--against", nargs="+", metavar="LOG", help="stats.py --against: the group to compare with "
                        "(logs, folders or quoted globs)")
    parser.add_argument("--target", type=stats.loss_target, default=stats.TARGET, help="stats.py --target (3.28)")
    parser.add_argument("--alpha", type=stats.probability, default=stats.ALPHA, help="stats.py --alpha (0.01)")
    parser.add_argument("--plot", metavar="OUT.png", help="stats.py --plot: the runs' final losses and times")
    parser.add_argument("--check", action="store_true", help="check these options, and the script's with its own "
                        "--check where it has one (train_gpt.py does), then exit (run.sh does this before it "
                        "downloads or generates data)")
    args, script_args = parser.parse_known_args(argv)
    if not os.path.isfile(args.script):
        parser.error(f"--script {args.script}: no such file ({os.path.abspath(args.script)}); give the path of "
                     f"your copy of train_gpt.py")
    if importlib.util.find_spec("jax") is None:  # the runs use this Python, and the script needs JAX
        parser.error(f"this Python ({sys.executable}) has no jax, which {shown(args.script)} needs: run this in the "
                     f"environment ./run.sh made (source .venv/bin/activate first), or as ./run.sh --runs N ...")
    if args.against:
        try:  # now rather than after N runs
            against = expand(args.against, "--against")
            stats.load_runs(against, skip_incomplete=False, fix="name only finished runs' logs in --against")
        except LogError as e:
            parser.error(str(e))
        args.against = against
    if args.plot:  # likewise: a missing extra or folder must not cost the attempt its verdict
        missing = [m for m in PLOT_EXTRAS if importlib.util.find_spec(m) is None]
        if missing:
            parser.error(f"--plot needs {' and '.join(missing)}, optional extras not installed here: pip install "
                         f"{' '.join(missing)}, or leave --plot out (records/stats.py --plot draws it later)")
        if problem := plot_path_problem(args.plot):
            parser.error(problem)
    return args, script_args


def has_check(script: str) -> bool:
    """Whether the script can check its options alone (train_gpt.py --check; the record-20 archive cannot)."""
    with open(script, errors="replace") as f:
        return 'add_argument("--check"' in f.read()


def script_check(script: str, script_args: list) -> int:
    """The script's own check of its options, where it has one: its exit code."""
    if not has_check(script):
        say(f"{script} has no --check: its options are checked when it runs")
        return 0
    return subprocess.run([sys.executable, script, *script_args, "--check"]).returncode


def shown(path: str) -> str:
    """A path as the verdict's command names it: relative to the current folder when inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


class Run:
    def __init__(self, number: int, seed: int):
        self.number, self.seed = number, seed
        self.code, self.log, self.parsed, self.seconds, self.interrupted = None, None, None, 0.0, False

    @property
    def failed(self) -> bool:
        return self.code not in (0, 2, *INTERRUPTED) and not self.interrupted

    @property
    def final_loss(self):
        return self.parsed.final_val_loss if self.parsed and self.parsed.finished else None

    def describe(self) -> str:
        if self.code == 0:
            outcome = "finished"
        elif self.code in INTERRUPTED or self.interrupted:
            outcome = "interrupted"
        else:
            outcome = "bad flags or data (exit 2)" if self.code == 2 else f"FAILED (exit {self.code})"
        loss = f", final val loss {self.final_loss:.4f}" if self.final_loss is not None else ""
        return (f"run {self.number} (seed {self.seed}): {outcome}{loss}, {self.seconds:.0f}s, "
                f"log {shown(self.log) if self.log else '(none)'}")


def run_once(run: Run, command: list, stop: dict) -> None:
    """The script in a subprocess, its output passed through; its log is the path it prints."""
    start = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    stop["child"] = child
    for line in child.stdout:
        say(line, end="")
        if m := LOG_LINE.match(line.rstrip("\n")):
            run.log = m[1]
    run.code = child.wait()
    stop["child"] = None
    run.seconds = time.monotonic() - start
    run.interrupted = stop["signal"] is not None and run.code != 0  # e.g. Ctrl-C before train() set its handler
    if run.log:
        try:
            run.parsed = parse_log(run.log)
        except LogError as e:  # left out of the verdict, said here
            say(f"attempt: {e}")


def tally(runs: list, total: int) -> str:
    losses = [r.final_loss for r in runs if r.final_loss is not None]
    mean = "no final loss yet" if not losses else f"mean final val loss {statistics.mean(losses):.4f}" + (
        f" (std {statistics.stdev(losses):.4f})" if len(losses) > 1 else "")
    last, done = runs[-1], len(runs)
    if last.code in INTERRUPTED or last.interrupted:  # an interrupted run is not done: the attempt stops
        done, end = done - 1, f"stopped: run {last.number} interrupted"
    elif done < total:
        end = f"ETA {(total - done) * statistics.mean(r.seconds for r in runs) / 60:.1f} min"
    else:
        end = "all done"
    return (f"attempt: {done} of {total} runs done, {sum(r.failed for r in runs)} failed; {mean} over "
            f"{len(losses)} finished; {end}")


def verdict(args, runs: list, total: int, command: str) -> str:
    """records/stats.py's report over the runs' readable logs, unfinished ones included
    (--skip-incomplete names them, and a failed run voids the claim), under a header naming the
    runs and the stats.py command that prints the same report."""
    logs = [shown(r.log) for r in runs if r.parsed]
    argv = [*logs, "--target", str(args.target), "--alpha", str(args.alpha)]
    if any(not r.parsed.finished for r in runs if r.parsed):
        argv.append("--skip-incomplete")
    if args.against:
        argv += ["--against", *map(shown, args.against)]
    if args.plot:
        argv += ["--plot", args.plot]
    report = io.StringIO()
    with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
        stats.main(argv)  # stats.py's own code, so that its command line prints the same
    finished = sum(r.code == 0 for r in runs)
    stopped_early = len(runs) < total or (runs[-1].code != 0 and not runs[-1].failed)
    lines = [f"attempt verdict{f' -- partial ({finished} of {total} runs)' if stopped_early else ''}: "
             f"{command}", *(r.describe() for r in runs)]
    if failed := [r for r in runs if r.failed]:
        lines.append(f"failed: {', '.join(f'run {r.number} (seed {r.seed})' for r in failed)}; a record claim "
                     f"cannot hold with failed runs")
    if stopped_early:
        lines.append(f"note: a test of {finished} of the {total} runs planned: stopping an attempt when its result "
                     f"looks good makes a p-value smaller than it is; a claim counts the runs planned (--runs)")
    lines.append(f"reproduce (in {os.getcwd()}): python {shlex.join([shown(stats.__file__), *argv])}")
    return "\n".join(lines) + "\n" + report.getvalue()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, script_args = parse_args(argv)
    if code := script_check(args.script, script_args):  # its bad options now, not in run 1
        return code
    if args.check:
        return 0
    base = args.seed if args.seed is not None else random.SystemRandom().randrange(1_000_000)
    command = f"python {shlex.join([shown(__file__), *argv])}" + ("" if args.seed is not None else f" --seed {base}")
    say(f"attempt: {args.runs} run(s) of {shown(args.script)}, seeds {base}..{base + args.runs - 1}"
        + ("" if args.seed is not None else f" (random; --seed {base} repeats them)"))

    stop = {"signal": None, "child": None}

    def on_signal(signum, frame):
        stop["signal"] = signum
        if signum == signal.SIGTERM and stop["child"]:  # sent to us alone; Ctrl-C's SIGINT reaches the run itself
            stop["child"].terminate()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    runs = []
    for i in range(args.runs):
        if stop["signal"]:  # between runs
            break
        run = Run(i + 1, base + i)
        runs.append(run)
        script_command = [sys.executable, args.script, *script_args, "--seed", str(run.seed)]
        say(f"attempt: run {run.number} of {args.runs}, seed {run.seed}: "
            f"{shlex.join([shown(args.script), *script_command[2:]])}")
        run_once(run, script_command, stop)
        if run.code == 2:  # no tally: this says what happened
            say(f"attempt: stopped: run {run.number} exited 2 (bad flags or data, said above); every run would "
                f"fail the same way: fix it and start the attempt again", file=sys.stderr)
            break
        say(tally(runs, args.runs))
        if run.code == 0 and not run.log:
            say(f"attempt: stopped: {args.script} finished run {run.number} without printing a line "
                f"'record log: PATH', so its log cannot be found: it is probably a copy of train_gpt.py older "
                f"than records/attempt.py; copy train_gpt.py again, or print that line where train() opens "
                f"its log", file=sys.stderr)
            return 2
        if run.code in INTERRUPTED or run.interrupted:
            break
    if logged := [r for r in runs if r.parsed]:
        text = verdict(args, runs, args.runs, command)
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
        path = os.path.join(os.path.dirname(logged[0].log), f"attempt_{stamp}_{uuid.uuid4().hex[:8]}.verdict")
        with open(path, "x") as f:  # not .txt: a folder or glob of logs must not pick it up
            f.write(text)
        say(f"\n{text}verdict saved to {shown(path)}")
    else:
        say("attempt: no run left a readable log: no verdict")
    # runs is empty only when a signal came before the first run
    if signum := stop["signal"] or INTERRUPTED.get(runs[-1].code):
        return 128 + signum
    if runs[-1].code == 2:
        return 2
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
