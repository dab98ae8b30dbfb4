"""Read the record logs that train_gpt.py writes (layout: README.md, "Record logs").

parse_log(path) -> RunLog reads any log, finished or not; require_complete(run) raises LogError
unless the run finished, because only finished runs have a final val loss and a total time.
"""
import dataclasses
import json
import re

RULE = "=" * 100
VAL_LINE = re.compile(r"^step:(\d+)/(\d+) val_loss:(\S+) train_time:(\d+)ms step_avg:(\S+)ms$")
TRAIN_LINE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:(\S+)ms$")
COMPILE_LINE = re.compile(r"^compile: ([0-9.]+)s")
SUMMARY_FIELD = re.compile(r"(\w+):(\S+)")


class LogError(ValueError):
    """Not a usable train_gpt.py record log; the message names the file and says why."""


@dataclasses.dataclass
class RunLog:
    path: str
    source: str  # the embedded train_gpt.py, verbatim
    environment: list  # Python/jax versions, devices, nvidia-smi output
    preset: str
    hyperparameters: dict
    compile_s: float | None = None
    val_curve: list = dataclasses.field(default_factory=list)  # (step, val_loss, train_time_ms)
    train_steps: list = dataclasses.field(default_factory=list)  # (step, train_time_ms, step_avg_ms)
    summary: dict = dataclasses.field(default_factory=dict)
    status: str = "truncated"  # complete | interrupted | stopped | truncated (killed, or still running)
    last_line: str = ""

    @property
    def final_val_loss(self) -> float:
        return self.summary["final_val_loss"]

    @property
    def train_time_ms(self) -> float:
        return self.summary["train_time_ms"]

    @property
    def last_step(self) -> int:
        """The last step the log reached (a training step done, or a validation at that step)."""
        return max([s for s, *_ in self.train_steps + self.val_curve], default=0)


def _number(text: str) -> float | None:
    return None if text == "n/a" else float(text.removesuffix("ms").removesuffix("MiB"))


def _summary(fields: dict) -> dict:
    return {"final_val_loss": float(fields["final_val_loss"]),
            "train_time_ms": _number(fields["train_time"]),
            "step_avg_ms": _number(fields["step_avg"]),
            "tokens_per_s": float(fields["tokens_per_s"]),
            "compile_s": float(fields["compile_s"]),
            "peak_memory_mib": _number(fields["peak_memory"])}


def parse_log(path: str) -> RunLog:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise LogError(f"{path}: cannot read it as a text log ({e})") from None
    # The embedded source may contain anything, even a rule: the header starts at the first rule
    # followed by "Running Python", and step lines are only looked for after the hyperparameters.
    starts = [i for i in range(len(lines) - 1) if lines[i] == RULE and lines[i + 1].startswith("Running Python")]
    if not starts:
        raise LogError(f"{path} is not a train_gpt.py record log (no line of 100 '=' followed by "
                       f"'Running Python ...' after the embedded source)")
    env_start = starts[0] + 1
    rules = [i for i in range(env_start, len(lines)) if lines[i] == RULE]
    if len(rules) < 2 or not lines[rules[0] + 1].startswith("Hyperparameters (preset "):
        raise LogError(f"{path} is cut off in its header, before the end of the hyperparameters block: "
                       f"the run wrote nothing else (killed at start?)")
    preset = lines[rules[0] + 1].removeprefix("Hyperparameters (preset ").removesuffix("):")
    try:
        hyperparameters = json.loads("\n".join(lines[rules[0] + 2: rules[1]]))
    except json.JSONDecodeError as e:
        raise LogError(f"{path}: the hyperparameters block is not valid JSON ({e}); was the log edited?") from None
    run = RunLog(path, "\n".join(lines[: starts[0]]) + "\n", lines[env_start: rules[0]], preset, hyperparameters)
    for line in lines[rules[1] + 1:]:
        if m := VAL_LINE.match(line):
            run.val_curve.append((int(m[1]), float(m[3]), float(m[4])))
        elif m := TRAIN_LINE.match(line):
            run.train_steps.append((int(m[1]), float(m[3]), float(m[4])))
        elif m := COMPILE_LINE.match(line):
            run.compile_s = float(m[1])
        elif line.startswith("summary "):
            try:
                run.summary = _summary(dict(SUMMARY_FIELD.findall(line)))
            except (KeyError, ValueError) as e:
                raise LogError(f"{path}: malformed summary line ({e!r} in {line!r}); was the log edited?") from None
        elif line == "run complete":
            run.status = "complete"
        elif line.startswith("interrupted at step"):
            run.status = "interrupted"
        elif line.startswith("stopped:"):
            run.status = "stopped"
        if line:
            run.last_line = line
    if run.status == "complete" and not run.summary:
        raise LogError(f"{path} says 'run complete' but has no summary line; was the log edited?")
    return run


def require_complete(run: RunLog) -> RunLog:
    """Only finished runs have a final val loss and a total time to compare or test."""
    if run.status != "complete":
        N = run.hyperparameters.get("num_iterations", "?")
        how = "truncated: killed, or still running" if run.status == "truncated" else run.status
        raise LogError(f"{run.path}: the run did not finish ({how}, at step {run.last_step}/{N}; last line: "
                       f"{run.last_line!r}); only complete runs can be compared or tested")
    return run
