"""Read record logs in either layout into one RunLog:

- ours, written by train_gpt.py (README.md, "Record logs"): source, a line of 100 '=', environment,
  '=', `Hyperparameters (preset NAME):` + JSON, '=', compile/step lines, `summary ...`, `run complete`;
- the PyTorch speedrun's (KellerJordan/modded-nanogpt, records 18-22 and 89): source, '=', `Running Python`,
  `Running PyTorch`, nvidia-smi, '=', step lines, `peak memory allocated: N MiB reserved: M MiB`.
  Its hyperparameters are the defaults of the source's `Hyperparameters` dataclass, read with `ast`
  (literals and simple arithmetic only; nothing is executed). Records 18-21 restart their clock
  after the first 10 steps (they include compilation); later ones compile in a warm-up before it
  starts. The last val line's train_time is the record's time; a non-finite final val loss (the
  PyTorch script trains on after a NaN) makes the run a stopped one, as our runs stop on one.

parse_log(path) -> RunLog reads any log, finished or not; require_complete(run) raises LogError
unless the run finished, because only finished runs have a final val loss and a total time.

  python records/logs.py LOG...   how each run ended, its time, and (ours) its step time by stage
                                  (LOG: a log, a folder of them, or a glob)
"""
import argparse
import ast
import dataclasses
import glob
import hashlib
import json
import math
import operator
import os
import re
import sys

RULE = "=" * 100
OURS, PYTORCH = "jax", "pytorch"
LAYOUT_NAMES = {OURS: "JAX train_gpt.py log", PYTORCH: "PyTorch speedrun log"}
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms step_avg:(\S+)ms$")
TRAIN_LINE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:(\S+)ms$")
COMPILE_LINE = re.compile(r"^compile: ([0-9.]+)s")
SUMMARY_FIELD = re.compile(r"(\w+):(\S+)")
PEAK_LINE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB$")
DEVICES_LINE = re.compile(r"^Devices: (\d+) x (.+) \(\w+\) in \d+ process\(es\)$")  # ours
SMI_GPU_ROW = re.compile(r"^\|\s+\d+\s+(.+?)\s+(?:On|Off)\s+\|")  # nvidia-smi: `|   0  NVIDIA H100 80GB HBM3   On  |`
STAGES_LINE = re.compile(r"stages at \[([\d, ]+)\], batch \[([\d, ]+)\] tokens")  # ours: the run's preset line


class LogError(ValueError):
    """Not a usable record log; the message names the file and says why."""


class Expression(str):
    """A PyTorch hyperparameter whose default is not a literal or simple arithmetic: kept as its
    source text, never executed."""

    def __repr__(self):
        return f"<expression {str(self)}>"


@dataclasses.dataclass
class RunLog:
    path: str
    layout: str  # OURS or PYTORCH
    source: str  # the embedded training script, verbatim
    environment: list  # versions, devices, nvidia-smi output
    hyperparameters: dict
    digest: str  # sha256 of its text (line ends as \n): the same log under two names, or copied, is one run
    preset: str | None = None  # ours only
    compile_s: float | None = None  # ours only: compilation happens before our clock starts
    val_curve: list = dataclasses.field(default_factory=list)  # (step, val_loss, train_time_ms)
    train_steps: list = dataclasses.field(default_factory=list)  # (step, train_time_ms, step_avg_ms)
    total_steps: int | None = None  # M of the step lines' step:N/M
    untimed_steps: int = 0  # PyTorch: steps before its clock restarted (they include compilation)
    clock_ms: float | None = None  # train_time of the last step line, val or train
    summary: dict = dataclasses.field(default_factory=dict)  # ours only
    peak_memory_mib: float | None = None
    status: str = "truncated"  # complete | interrupted | stopped | truncated (killed, or still running)
    last_line: str = ""
    stop_reason: str = ""  # why a run whose lines went to the end counts as stopped (PyTorch's NaN)
    stage_starts: list = dataclasses.field(default_factory=list)  # ours: the steps where stages start (0, ...)
    stage_batches: list = dataclasses.field(default_factory=list)  # ours: tokens a step in each stage

    @property
    def finished(self) -> bool:
        return self.status == "complete"

    @property
    def final_val_loss(self) -> float:
        return self.summary["final_val_loss"] if self.summary else self.val_curve[-1][1]

    @property
    def train_time_ms(self) -> float:
        """The total time of a finished run; of an unfinished one, the time its last step line shows."""
        return self.summary["train_time_ms"] if self.summary else self.clock_ms

    @property
    def steps_done(self) -> int:
        return max([s for s, *_ in self.train_steps], default=0)

    @property
    def timed_steps(self) -> int:
        return self.steps_done - self.untimed_steps

    @property
    def step_avg_ms(self) -> float:
        if self.summary and self.summary["step_avg_ms"] is not None:  # ours: from the unrounded total
            return self.summary["step_avg_ms"]
        return self.train_time_ms / self.timed_steps if self.timed_steps > 0 and self.clock_ms is not None \
            else float("nan")

    @property
    def tokens_per_s(self) -> float | None:
        """Training throughput on the run's own clock; None for a PyTorch log that names no batch size."""
        if self.summary:
            return self.summary["tokens_per_s"]
        batch = self.hyperparameters.get("batch_size")
        if not isinstance(batch, (int, float)) or not self.timed_steps or not self.clock_ms:
            return None
        return batch * self.timed_steps / (self.clock_ms / 1000)

    @property
    def last_step(self) -> int:
        """The last step the log reached (a training step done, or a validation at that step)."""
        return max([s for s, *_ in self.train_steps + self.val_curve], default=0)

    @property
    def num_iterations(self):
        return self.total_steps or self.hyperparameters.get("num_iterations")

    @property
    def devices(self) -> tuple | None:
        """(count, kind) of the devices that ran it: ours from the `Devices:` line, a PyTorch log from
        its nvidia-smi table (a row per GPU); None when the log does not say."""
        if self.layout == OURS:
            return next(((int(m[1]), m[2]) for line in self.environment if (m := DEVICES_LINE.match(line))), None)
        kinds = [m[1] for line in self.environment if (m := SMI_GPU_ROW.match(line))]
        return (len(kinds), kinds[0]) if kinds and len(set(kinds)) == 1 else None

    def time_at_step(self, step: int) -> float | None:
        """train_time (ms) of the step line `step:{step}/N`; None if the log has none."""
        return next((ms for s, ms, _ in self.train_steps if s == step), None)

    def stage_step_ms(self) -> list:
        """Step time by stage (ours): [{stage, batch, steps, ms, tokens_per_s}], from the train_time
        differences of the stage's steps, leaving out those whose time is not the stage's pace: its
        first and last step (the host waits for a program's first run, or the next stage's) and the
        steps at and after a validation (the loop reads step s's loss after dispatching step s + 1).
        Stage k holds the log's steps stage_starts[k] + 1 .. stage_starts[k + 1]; ms and tokens_per_s
        are None where no step is left."""
        time_at = {s: ms for s, ms, _ in self.train_steps} | {0: 0.0}
        vals = {s for s, *_ in self.val_curve}
        ends = self.stage_starts[1:] + [self.num_iterations or self.steps_done]
        rows = []
        for k, (start, end) in enumerate(zip(self.stage_starts, ends)):
            steps = [i for i in range(start + 2, end) if i in time_at and i - 1 in time_at
                     and i not in vals and i - 1 not in vals]
            ms = sum(time_at[i] - time_at[i - 1] for i in steps) / len(steps) if steps else None
            batch = self.stage_batches[k]
            rows.append({"stage": k, "batch": batch, "steps": steps, "ms": ms,
                         "tokens_per_s": batch / ms * 1000 if ms else None})
        return rows

    def describe(self) -> str:
        preset = f", preset {self.preset}" if self.preset else ""
        return f"{LAYOUT_NAMES[self.layout]}{preset}, {self.num_iterations or '?'} steps"


def _number(text: str) -> float | None:
    return None if text == "n/a" else float(text.removesuffix("ms").removesuffix("MiB"))


def _summary(fields: dict) -> dict:
    return {"final_val_loss": float(fields["final_val_loss"]),
            "train_time_ms": _number(fields["train_time"]),
            "step_avg_ms": _number(fields["step_avg"]),
            "tokens_per_s": float(fields["tokens_per_s"]),
            "compile_s": float(fields["compile_s"]),
            "peak_memory_mib": _number(fields["peak_memory"])}


# ---- PyTorch hyperparameters: the dataclass defaults, evaluated without executing anything

_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


class _NotSimple(Exception):
    pass


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def simple_value(node: ast.AST):
    """The value of a literal or of arithmetic over number literals (`48*1024`, `2**-3`, `-0.5`);
    raises _NotSimple for anything else (names, calls, attributes...)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = simple_value(node.operand)
        if _is_number(value):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left, right = simple_value(node.left), simple_value(node.right)
        # a huge power (9**9**9) would hang the reader; hyperparameters never need one
        if _is_number(left) and _is_number(right) and not (isinstance(node.op, ast.Pow) and abs(right) > 64):
            try:
                return _ARITHMETIC[type(node.op)](left, right)
            except ArithmeticError:
                pass
    if isinstance(node, (ast.Tuple, ast.List)):
        return [simple_value(e) for e in node.elts]
    raise _NotSimple


# Later PyTorch records print more files after the script: a line of 40 '-', `# triton_kernels.py`, a
# line of 40 '-', then that file's code. The hyperparameters are the script's, the first file.
FILE_BLOCK = re.compile(r"^-{40}\n# \S+\n-{40}$", re.M)


def dataclass_hyperparameters(source: str, path: str) -> dict:
    """name -> default of each `name = value` / `name: type = value` line of the source's first
    `class Hyperparameters` ({} if it has none); a default that is not simple stays an Expression.
    Only the first file of the embedded source is read (FILE_BLOCK)."""
    try:
        tree = ast.parse(FILE_BLOCK.split(source, maxsplit=1)[0])
    except SyntaxError as e:
        raise LogError(f"{path}: the embedded source is not valid Python (line {e.lineno}: {e.msg}); "
                       f"was the log edited?") from None
    cls = next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters"), None)
    hyperparameters = {}
    for stmt in cls.body if cls else []:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
            name = stmt.target.id
        else:
            continue
        try:
            hyperparameters[name] = simple_value(stmt.value)
        except _NotSimple:
            hyperparameters[name] = Expression(ast.get_source_segment(source, stmt.value))
    return hyperparameters


# ---- the console and --plot, for the tools


def say(text: str = "", file=None, end: str = "\n") -> None:
    """print, where a console that is gone (the reader of a pipe: `| head`, `| less` quit early; `| tee`
    killed by the same Ctrl-C) is not the tool's error: later lines go nowhere (train_gpt.py has its twin)."""
    file = file or sys.stdout
    try:
        print(text, file=file, end=end, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), file.fileno())


def plot_path_problem(path: str) -> str:
    """Why --plot PATH cannot be written ('' if it can), asked before any work: its folder must be one
    this user can write to, and its extension a format matplotlib writes (imported here: --plot needs it)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        return f"--plot {path}: {folder} is no folder this user can write to"
    if os.path.isdir(path):
        return f"--plot {path} is a folder: give a file name, e.g. {os.path.join(path, 'plot.png')}"
    import matplotlib  # first: it may be missing while its submodules are imported already

    matplotlib.use("Agg")  # no display needed, as the plots themselves
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in formats:
        return (f"--plot {path}: {'a file name without an extension' if not extension else repr(extension)} is not "
                f"a format matplotlib writes; name the file .png (or {', '.join(sorted(formats))})")
    return ""


def plot_refused(parser, path: str, extras: tuple) -> bool:
    """--plot's check before any work: parser.error where the path cannot be written; True, said on
    stderr, where `extras` (the optional packages the plot needs) are not installed."""
    try:
        problem = plot_path_problem(path)
    except ImportError as e:
        kind = "optional extras" if len(extras) > 1 else "an optional extra"
        print(f"error: --plot needs {' and '.join(extras)}, {kind} ({e}): pip install {' '.join(extras)}",
              file=sys.stderr)
        return True
    if problem:
        parser.error(problem)
    return False


# ---- the reader

def _looks_like_a_script(lines: list) -> bool:
    first = next((line for line in lines if line.strip()), "")
    return first.startswith(('"""', "'''", "#", "import ", "from "))


def expand(patterns: list, flag: str) -> list:
    """Log paths: a folder stands for its *.txt files, a pattern with * ? [ for its matches (sorted;
    records/attempt.py's .verdict files beside its logs left out)."""
    paths = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            found = sorted(glob.glob(os.path.join(pattern, "*.txt")))
            why = f"the folder {os.path.abspath(pattern)} holds no .txt log"
        elif any(c in pattern for c in "*?["):
            found = sorted(p for p in glob.glob(pattern) if not p.endswith(".verdict"))
            why = f"no file matches {os.path.abspath(pattern)}"
        else:
            found, why = [pattern], ""
        if not found:
            raise LogError(f"{flag}: {why}")
        paths += found
    return paths


def parse_log(path: str) -> RunLog:
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8").replace("\r\n", "\n")  # a copy through Windows too: the same log
        lines = text.split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise LogError(f"{os.path.abspath(path)}: cannot read it as a text log ({e})") from None
    # The embedded source may contain anything, even a rule: the header starts at the first rule
    # followed by "Running Python", and step lines are only looked for after the header.
    starts = [i for i in range(len(lines) - 1) if lines[i] == RULE and lines[i + 1].startswith("Running Python")]
    if not starts:
        if _looks_like_a_script(lines):
            raise LogError(f"{path} is cut off inside its embedded source (no line of 100 '=' followed by "
                           f"'Running Python ...' after it): the run was killed while writing its header, "
                           f"or this is a script, not a record log")
        raise LogError(f"{path} is not a record log of train_gpt.py or of the PyTorch speedrun (no line of "
                       f"100 '=' followed by 'Running Python ...' after the embedded source)")
    env_start = starts[0] + 1
    rules = [i for i in range(env_start, len(lines)) if lines[i] == RULE]
    env_end = rules[0] if rules else len(lines)
    layout = PYTORCH if any(line.startswith("Running PyTorch") for line in lines[env_start:env_end]) else OURS
    if not rules:
        raise LogError(f"{path} is cut off in its header, in the environment block (no line of 100 '=' "
                       f"after it): the run wrote nothing else (killed at start?)")
    environment = lines[env_start:env_end]
    while environment and not environment[-1].strip():  # nvidia-smi's own trailing newline
        environment.pop()
    digest = hashlib.sha256(text.encode()).hexdigest()
    if layout == PYTORCH:
        # print(code) added a newline after the code's own final one: that blank line is not source
        source = "\n".join(lines[: starts[0]])
        run = RunLog(path, layout, source, environment, dataclass_hyperparameters(source, path), digest)
        body = lines[env_end + 1:]
    else:
        if len(rules) < 2 or not lines[rules[0] + 1].startswith("Hyperparameters (preset "):
            raise LogError(f"{path} is cut off in its header, before the end of the hyperparameters block: "
                           f"the run wrote nothing else (killed at start?)")
        try:
            hyperparameters = json.loads("\n".join(lines[rules[0] + 2: rules[1]]))
        except json.JSONDecodeError as e:
            raise LogError(f"{path}: the hyperparameters block is not valid JSON ({e}); was the log edited?") from None
        preset = lines[rules[0] + 1].removeprefix("Hyperparameters (preset ").removesuffix("):")
        run = RunLog(path, layout, "\n".join(lines[: starts[0]]) + "\n", environment, hyperparameters, digest, preset)
        body = lines[rules[1] + 1:]
    _read_body(run, body)
    return run


def _read_body(run: RunLog, lines: list) -> None:
    for line in lines:
        if m := VAL_LINE.match(line):
            run.val_curve.append((int(m[1]), float(m[3]), float(m[4])))
            run.total_steps, run.clock_ms = int(m[2]), float(m[4])
        elif m := TRAIN_LINE.match(line):
            if run.train_steps and float(m[3]) < run.train_steps[-1][1]:
                run.untimed_steps = run.train_steps[-1][0]  # the PyTorch clock restarted after this step
            run.train_steps.append((int(m[1]), float(m[3]), float(m[4])))
            run.total_steps, run.clock_ms = int(m[2]), float(m[3])
        elif run.layout == OURS and not run.stage_starts and (m := STAGES_LINE.search(line)):
            run.stage_starts, run.stage_batches = [int(x) for x in m[1].split(",")], [int(x) for x in m[2].split(",")]
        elif m := COMPILE_LINE.match(line):
            run.compile_s = float(m[1])
        elif m := PEAK_LINE.match(line):
            run.peak_memory_mib = float(m[1])
        elif line.startswith("summary "):
            try:
                run.summary = _summary(dict(SUMMARY_FIELD.findall(line)))
            except (KeyError, ValueError) as e:
                raise LogError(f"{run.path}: malformed summary line ({e!r} in {line!r}); was the log edited?") from None
            run.peak_memory_mib = run.summary["peak_memory_mib"]
        elif line == "run complete":
            run.status = "complete"
        elif line.startswith("interrupted at step"):
            run.status = "interrupted"
        elif line.startswith("stopped:"):
            run.status = "stopped"
        if line:
            run.last_line = line
    if run.layout == PYTORCH and run.val_curve and run.val_curve[-1][0] == run.total_steps:
        final = run.val_curve[-1][1]  # the last step's validation is the record's result
        if math.isfinite(final):
            run.status = "complete"
        else:
            run.status, run.stop_reason = "stopped", f"its final val_loss is {final}: it diverged"
    if run.layout == OURS and run.status == "complete" and not run.summary:
        raise LogError(f"{run.path} says 'run complete' but has no summary line; was the log edited?")


def synthetic_shards(run: RunLog, key: str = "train_files") -> bool:
    """Whether the run's shards (hyperparameter `key`, a glob) are data/synthetic.py's: named
    synthetic_*.bin, or in its default folder data/synthetic."""
    folder, name = os.path.split(os.path.normpath(str(run.hyperparameters.get(key, ""))))
    return name.startswith("synthetic_") or os.path.basename(folder) == "synthetic"


def require_complete(run: RunLog, fix: str = "") -> RunLog:
    """Only finished runs have a final val loss and a total time to compare or test; `fix`: what the
    caller offers instead, said at the end of the error."""
    if not run.finished:
        how = "truncated: killed, or still running" if run.status == "truncated" else run.status
        why = run.stop_reason or f"last line: {run.last_line!r}"
        raise LogError(f"{run.path}: the run did not finish ({how}, at step {run.last_step}/"
                       f"{run.num_iterations or '?'}; {why}); only complete runs can be "
                       f"compared or tested" + (f" ({fix})" if fix else ""))
    return run


def _ranges(steps: list) -> str:
    """[2, 3, 4, 7] -> '2-4, 7'."""
    runs = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="How each run ended, its time and (ours) its step time by stage.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="a log, a folder (its *.txt logs) or a glob")
    bad = 0
    try:
        paths = expand(parser.parse_args(argv).logs, "LOG")
    except LogError as e:
        parser.error(str(e))
    for path in paths:
        try:
            run = parse_log(path)
        except LogError as e:
            print(f"error: {e}", file=sys.stderr)
            bad += 1
            continue
        final = f"final val_loss {run.final_val_loss:.4f}, " if run.finished else \
            f"{run.stop_reason or run.last_line}; " if run.status == "stopped" else ""  # why it stopped
        say(f"{path}: {run.describe()}, {run.status} at step {run.last_step}; {final}train_time "
              f"{run.train_time_ms or 0:.0f} ms over {run.timed_steps} timed steps, step_avg {run.step_avg_ms:.2f} ms"
              + (f", compile {run.compile_s:.1f} s" if run.compile_s is not None else ""))
        for row in run.stage_step_ms():
            steps = ("steps " if len(row["steps"]) > 1 else "step ") + _ranges(row["steps"])
            pace = (f"{row['ms']:.2f} ms, {row['tokens_per_s']:.0f} tokens/s over {steps}"
                    if row["ms"] else "n/a (no step of its pace)")
            say(f"  stage {row['stage']} ({row['batch']:,} tokens a step): {pace}")
    return 2 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
