"""records/: the reader, compare and stats, on logs of the real trainer, on logs written here in
train_gpt.py's layout (fast, for many curves), and on logs written here in the PyTorch speedrun's."""
import ast
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import stats as scipy_stats  # noqa: E402

import train_gpt as tg  # noqa: E402  (only for its Hyperparameters and source)
from conftest import TINY_STEPS, TINY_VAL_STEPS, TINY_VOCAB  # noqa: E402
from log_writers import (HP, NVIDIA_SMI, RULE, TORCH_0126_HYPERPARAMETERS, TORCH_89_EXTRA_FILE,  # noqa: E402
                         TORCH_89_HYPERPARAMETERS, hp_with, random_curve, torch_script, val_line, write_log,
                         write_torch_log)
from records import compare, stats  # noqa: E402
from records.logs import OURS, PYTORCH, Expression, LogError, parse_log, require_complete, simple_value  # noqa: E402
from records.logs import main as logs_main  # noqa: E402

# ---- logs written by the real trainer: two runs of conftest's tiny attempt (seeds 0 and 1)

@pytest.fixture
def real_logs(tiny_attempt):
    return [tiny_attempt.logs[0], tiny_attempt.logs[1]]


def test_the_real_trainers_log_parses(real_logs):
    a, b = (require_complete(parse_log(p)) for p in real_logs)
    with open(tg.__file__) as f:
        assert a.source == f.read()
    assert a.layout == OURS and a.preset == "cpu" and a.environment[0].startswith("Running Python")
    assert (a.hyperparameters["seed"], b.hyperparameters["seed"]) == (0, 1)
    assert a.hyperparameters.keys() == dataclasses.asdict(HP).keys()
    N = TINY_STEPS
    assert [s for s, *_ in a.val_curve] == TINY_VAL_STEPS
    assert [s for s, *_ in a.train_steps] == list(range(1, N + 1))
    assert a.val_curve[0][1] == pytest.approx(np.log(TINY_VOCAB), abs=0.01)  # near-uniform predictions at init
    # step 0's average as record 89's train_gpt.py prints it (train time / max(step, 1)), not nan
    with open(real_logs[0]) as f:
        assert f"step:0/{TINY_STEPS} val_loss:{a.val_curve[0][1]:.4f} train_time:0ms step_avg:0.00ms\n" in f.read()
    assert a.final_val_loss == pytest.approx(a.val_curve[-1][1], abs=1e-4)
    # the clock stops when the last step ends, before its line is written: the summary's time is that line's
    # (it was the time after writing it: 2 ms more under a loaded CPU, 2026-11-28)
    assert a.train_time_ms == a.train_steps[-1][1] and a.untimed_steps == 0
    assert a.timed_steps == N and a.compile_s > 0 and a.num_iterations == N
    assert (a.stage_starts, a.stage_batches) == ([0, 2, 4, 6], [1024] * 4)  # the preset line's stages


def test_the_fixture_writer_matches_the_real_trainers_layout(real_logs, tmp_path):
    """write_log (used for the many-curve tests) must not drift from what train() writes."""
    def shape(path):
        with open(path) as f:
            lines = f.read().split("\n")
        start = next(i for i, line in enumerate(lines) if line == RULE and lines[i + 1].startswith("Running Python"))
        rules = [i for i in range(start + 1, len(lines)) if lines[i] == RULE]
        kinds = []
        for line in lines[rules[1] + 1:]:
            kind = next((k for k, pattern in (("val", r"step:\d+/\d+ val_loss:"),
                                              ("train", r"step:\d+/\d+ train_time:"), ("compile", r"compile: "),
                                              ("summary", r"summary "), ("end", r"run complete$"))
                         if re.match(pattern, line)), None)
            if kind and kind not in kinds:
                kinds.append(kind)
        summary = next(line for line in lines if line.startswith("summary "))
        return len(rules), lines[rules[0] + 1].split("(")[0], kinds, re.findall(r"(\w+):", summary)

    ours = write_log(tmp_path / "fixture.txt", HP, random_curve(np.random.default_rng()), 100.0)
    assert shape(real_logs[0]) == shape(ours)
    assert shape(ours) == (2, "Hyperparameters ", ["compile", "val", "train", "summary", "end"],
                           ["final_val_loss", "train_time", "step_avg", "tokens_per_s", "compile_s", "peak_memory"])


def test_compare_and_stats_on_two_real_logs(real_logs, capsys):
    a, b = (parse_log(p) for p in real_logs)
    assert compare.main(real_logs) == 0
    out = capsys.readouterr().out
    assert "sources identical" in out and "seed: 0 -> 1" in out
    for (s, x, _), (_, y, _) in zip(a.val_curve, b.val_curve):
        assert f"{s:>6} {x:>8.4f} {y:>8.4f} {y - x:>+8.4f}" in out
    assert stats.main(real_logs) == 0
    out = capsys.readouterr().out
    assert "runs: 2 (2 JAX train_gpt.py logs)" in out
    assert f"mean {(a.final_val_loss + b.final_val_loss) / 2:.4f}" in out
    assert stats.main([real_logs[0], real_logs[0]]) == 0
    out = capsys.readouterr().out
    assert f"note: {real_logs[0]} is the same log as {real_logs[0]}: counted once" in out and "runs: 1 " in out


def test_a_real_log_cut_inside_its_source_is_reported_as_cut_off(real_logs, tmp_path):
    with open(real_logs[0]) as f:
        text = f.read()
    cut = tmp_path / "cut.txt"
    cut.write_text(text[: text.index("def train(")])
    with pytest.raises(LogError, match="is cut off inside its embedded source"):
        parse_log(str(cut))


# ---- our layout

def test_parse_log_reads_what_the_writer_wrote(tmp_path):
    curve = random_curve(np.random.default_rng())
    run = require_complete(parse_log(write_log(tmp_path / "a.txt", HP, curve, 100.0)))
    with open(tg.__file__) as f:
        assert run.source == f.read()
    assert run.environment[0].startswith("Running Python") and run.preset == "cpu" and run.layout == OURS
    assert run.hyperparameters == json.loads(json.dumps(dataclasses.asdict(HP)))  # the stage table as lists
    assert run.val_curve == [(s, v, 100.0 * s) for s, v in zip(range(0, 41, 10), curve)]
    assert run.train_steps[-1] == (40, 4000.0, 100.0) and len(run.train_steps) == 40
    assert run.compile_s == 12.3 and run.final_val_loss == curve[-1] and run.peak_memory_mib is None
    assert run.train_time_ms == 4000.0 and run.step_avg_ms == 100.0 and run.num_iterations == 40
    # the summary's step_avg, from the run's unrounded total (4000.4 ms: the log's train_time says 4000)
    odd = require_complete(parse_log(write_log(tmp_path / "b.txt", HP, curve, 100.01)))
    assert odd.train_time_ms == 4000.0 and odd.step_avg_ms == 100.01


def test_step_time_by_stage_leaves_out_first_last_and_validation_steps(tmp_path, capsys):
    """Each stage's pace from its steps' times (whole ms, so that the log's rounding is exact), without
    its first and last step and the steps at and after a validation; compare shows both logs'."""
    rng = np.random.default_rng()
    hp = hp_with(40, val_loss_every=int(rng.integers(4, 12)), num_extension_iterations=int(rng.integers(8, 12)))
    N, every = hp.total_steps, hp.val_loss_every
    step_ms = rng.integers(50, 500, N)
    run = parse_log(write_log(tmp_path / "a.txt", hp, random_curve(rng, N // every + 2), list(step_ms)))
    starts = [b[0] for b in tg.stage_bounds(hp)]
    assert run.stage_starts == starts and run.stage_batches == [st.batch_size for st in hp.stages]
    rows = run.stage_step_ms()
    for k, row in enumerate(rows):
        end = starts[k + 1] if k + 1 < len(starts) else N
        kept = [i for i in range(starts[k] + 1, end + 1)
                if i not in (starts[k] + 1, end) and i % every and (i - 1) % every]
        assert row["steps"] == kept
        if kept:
            assert row["ms"] == pytest.approx(np.mean([step_ms[i - 1] for i in kept]))
            assert row["tokens_per_s"] == pytest.approx(hp.stages[k].batch_size / row["ms"] * 1000)
        else:
            assert row["ms"] is None and row["tokens_per_s"] is None
    assert any(row["ms"] for row in rows) and rows[-1]["steps"]  # the extension too

    b = write_log(tmp_path / "b.txt", hp, random_curve(rng, N // every + 2), [ms - 10 for ms in step_ms])
    assert compare.main([str(tmp_path / "a.txt"), b]) == 0
    out = capsys.readouterr().out.split("== step time by stage")[1]
    for row in rows:
        if row["ms"]:
            assert re.search(rf"stage {row['stage']} .* A +{row['ms']:.2f} ms .* B-A -10\.00 ms", out)
    # validating every other step leaves no step of any stage's pace: each says so
    c = write_log(tmp_path / "c.txt", hp_with(40, val_loss_every=2), random_curve(rng, 22), 100.0)
    assert compare.main([c, c]) == 0
    out = capsys.readouterr().out.split("== step time by stage")[1]
    assert len(re.findall(r"stage \d +A +n/a \(no step of its pace\) +B +n/a \(no step of its pace\)", out)) == 4, out


def test_a_rule_and_step_lines_inside_the_embedded_source_do_not_confuse_the_parser(tmp_path):
    good = write_log(tmp_path / "a.txt", HP, random_curve(np.random.default_rng()), 100.0)
    fake = "\n".join([RULE, "Hyperparameters (preset fake):", "{}", RULE, val_line(7, 9, 1.0, 5.0), ""])
    with open(good) as f:
        text = f.read()
    (tmp_path / "b.txt").write_text(fake + text)
    a, b = parse_log(good), parse_log(str(tmp_path / "b.txt"))
    assert b.source == fake + a.source
    assert (b.preset, b.hyperparameters, b.val_curve) == (a.preset, a.hyperparameters, a.val_curve)


def test_compare_shows_the_changed_hyperparameter_and_curve_differences(tmp_path, capsys):
    rng = np.random.default_rng()
    va, vb = random_curve(rng), random_curve(rng)
    a = write_log(tmp_path / "a.txt", HP, va, step_ms=100.0)
    b = write_log(tmp_path / "b.txt", dataclasses.replace(HP, muon_lr=0.07), vb, step_ms=90.0)
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "sources identical" in out and "at common fractions" not in out  # same step counts
    assert re.search(r"== hyperparameters\nmuon_lr: 0.023 -> 0.07\n\n", out)  # only the changed key
    for step, x, y in zip(range(0, 41, 10), va, vb):
        assert f"{step:>6} {x:>8.4f} {y:>8.4f} {round(y - x, 4):>+8.4f}" in out
    assert "step_avg (ms)     A     100.00   B      90.00   B-A     -10.00 (-10.0%)" in out
    assert "train_time (ms)   A    4000.00   B    3600.00   B-A    -400.00 (-10.0%)" in out
    assert f"final_val_loss    A {va[-1]:10.4f}   B {vb[-1]:10.4f}" in out
    assert "peak_memory (MiB) A        n/a   B        n/a\n" in out and "clock of" not in out


def test_compare_diffs_the_embedded_sources(tmp_path, capsys):
    a = write_log(tmp_path / "a.txt", HP, random_curve(np.random.default_rng()), 100.0)
    with open(a) as f:
        text = f.read()
    assert "MUDD_SCALE = 0.1  #" in text
    (tmp_path / "b.txt").write_text(text.replace("MUDD_SCALE = 0.1  #", "MUDD_SCALE = 0.2  #", 1))
    assert compare.main([a, str(tmp_path / "b.txt")]) == 0
    out = capsys.readouterr().out
    assert f"--- {a}\n+++ {tmp_path / 'b.txt'}\n" in out
    assert "\n-MUDD_SCALE = 0.1  #" in out and "\n+MUDD_SCALE = 0.2  #" in out and "hyperparameters identical" in out


def test_a_baseline_column_without_values_says_where_the_baseline_is():
    run = lambda *steps: types.SimpleNamespace(val_curve=[(s, 4.0 + s / 100, 0.0) for s in steps])  # noqa: E731
    baseline = [(0, 10.8, 0.0), (125, 4.5, 9.0), (250, 4.2, 18.0)]
    rows = compare.curve_table(run(3, 6, 9), run(3, 6), baseline, "record20")
    assert rows[1:] == ["     3   4.0300   4.0300  +0.0000", "     6   4.0600   4.0600  +0.0000",
                        "(record20 has no value at these steps: its curve is at steps 0, 125, ..., 250; --plot draws it)"]
    rows = compare.curve_table(run(0, 3), run(0, 3), baseline, "record20")
    assert rows[1] == "     0   4.0000   4.0000  +0.0000   10.8000" and len(rows) == 3  # a value: no note


def test_compare_plot_is_a_png_with_both_runs_and_the_baseline(tmp_path, capsys):
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    b = write_torch_log(tmp_path / "b.txt", random_curve(rng))
    out = tmp_path / "cmp.png"
    assert compare.main([a, b, "--plot", str(out), "--baseline", "record20"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(out)).shape[2] in (3, 4)
    assert "  record20" in capsys.readouterr().out  # the table's baseline column
    baseline = compare.load_baseline("record20")
    assert baseline[0] == (0, 10.8258, 0.0) and baseline[-1] == (1393, 3.2785, 179527.0) and len(baseline) == 13
    # record 89's: the mean of its 13 published logs (1390 steps; their final losses average 3.2784)
    assert compare.load_baseline("record89") == [(0, 10.8306, 0.0), (250, 4.4616, 7947.0), (500, 4.159, 16844.0),
                                                 (750, 3.7363, 31089.0), (1000, 3.4632, 47386.0),
                                                 (1250, 3.3337, 68059.0), (1390, 3.2784, 79685.0)]
    fig = compare.plot(parse_log(a), parse_log(b), str(out), baseline, "record20")
    # two runs and the baseline in each panel of the whole curves, and in the decisive panel with the target line
    assert [len(ax.lines) for ax in fig.axes] == [3, 3, 3, 4]
    assert list(fig.axes[0].lines[1].get_ydata()) == [v for _, v, _ in parse_log(b).val_curve]
    assert list(fig.axes[1].lines[1].get_xdata()) == [s / 40 for s, _, _ in parse_log(b).val_curve]
    assert "(PyTorch)" in fig.axes[0].lines[1].get_label() and "(JAX, preset cpu)" in fig.axes[0].lines[0].get_label()
    # the curves' legend is the figure's, above the top row: none inside those panels, where it covered a
    # short run's curve
    assert [ax.get_legend() for ax in fig.axes[:3]] == [None] * 3
    [legend] = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [line.get_label() for line in fig.axes[0].lines]
    top_row = min(ax.get_window_extent().y0 for ax in fig.axes[:3])
    assert legend.get_window_extent().y0 > max(ax.get_window_extent().y1 for ax in fig.axes[:3]) > top_row
    fake = write_log(tmp_path / "s.txt", dataclasses.replace(HP, train_files="data/synthetic/synthetic_train_*.bin"),
                     random_curve(rng), 100.0)  # a run on synthetic shards says so beside the record's curve
    fig = compare.plot(parse_log(fake), parse_log(b), str(out), baseline, "record20")
    assert fig.axes[0].lines[0].get_label() == "A: s.txt (JAX, preset cpu, synthetic shards)"


def test_compare_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert compare.main([a, a, "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_compare_allow_incomplete_shows_the_partial_curve(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    b = write_log(tmp_path / "b.txt", HP, random_curve(rng), 100.0, end="interrupted")
    assert compare.main([a, b]) == 2  # refused, saying how to see it anyway
    err = capsys.readouterr().err
    assert err.startswith(f"error: {b}: the run did not finish") and "(--allow-incomplete shows its partial" in err
    monkeypatch.chdir(tmp_path)
    assert compare.main([a, "nothing.txt"]) == 2  # a missing file, named by its absolute path
    assert f"error: {tmp_path / 'nothing.txt'}: cannot read it as a text log" in capsys.readouterr().err
    assert compare.main([a, b, "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert "interrupted at step 20: partial curve" in out
    table = out.split("== validation loss at common steps\n")[1].split("\n\n")[0].splitlines()
    assert [int(row.split()[0]) for row in table[1:]] == [0, 10, 20]  # the common steps
    assert "train_time (ms)   A    4000.00   B    2000.00" in out  # B's time when it stopped


# ---- the PyTorch layout

def test_a_pytorch_log_reads_into_the_same_record(tmp_path):
    curve = random_curve(np.random.default_rng())
    run = require_complete(parse_log(write_torch_log(tmp_path / "t.txt", curve)))
    assert run.layout == PYTORCH and run.preset is None and run.source == torch_script()
    assert run.source.startswith("import os\n") and 'print0("=" * 100)' in run.source
    assert run.environment[:2] == ["Running Python 3.12.7 (main, Jan 17 2025, 03:57:17) [GCC 13.2.0]",
                                   "Running PyTorch 2.7.0.dev20250110+cu126 compiled for CUDA 12.6"]
    assert run.environment[2:] == NVIDIA_SMI.rstrip("\n").split("\n")  # its |===| line is no rule
    assert run.hyperparameters == {
        "train_files": "data/fineweb10B/fineweb_train_*.bin", "val_files": "data/fineweb10B/fineweb_val_*.bin",
        "val_tokens": 10485760, "batch_size": 524288, "num_iterations": 40, "cooldown_frac": 0.4,
        "val_loss_every": 10, "seq_len": 65536, "save_checkpoint": False}
    # the clock: steps 1-10 include compilation, then it restarts; 30 timed steps of 120 ms
    assert run.train_steps[9][:2] == (10, 18200.0) and math.isnan(run.train_steps[9][2])
    assert run.train_steps[10][:2] == (11, 120.0) and run.untimed_steps == 10 and run.timed_steps == 30
    assert [(s, v) for s, v, _ in run.val_curve] == list(zip(range(0, 41, 10), curve))
    assert [t for _, _, t in run.val_curve] == [0.0, 0.0, 1200.0, 2400.0, 3600.0]
    assert run.final_val_loss == curve[-1] and run.train_time_ms == 3600.0 and run.step_avg_ms == 120.0
    assert run.peak_memory_mib == 37653 and run.compile_s is None and run.num_iterations == 40
    assert run.tokens_per_s == pytest.approx(30 * 524288 / 3.6)
    assert run.last_line == "peak memory allocated: 37653 MiB reserved: 39236 MiB"


@pytest.mark.parametrize("end, message", [
    ("source", "is cut off inside its embedded source"),
    ("environment", "is cut off in its header, in the environment block"),
])
def test_a_pytorch_log_cut_off_in_its_header_is_rejected(tmp_path, capsys, end, message):
    good = write_torch_log(tmp_path / "good.txt", random_curve(np.random.default_rng()))
    bad = write_torch_log(tmp_path / "bad.txt", random_curve(np.random.default_rng()), end=end)
    with pytest.raises(LogError, match=message):
        parse_log(bad)
    for tool in (compare.main, stats.main):
        assert tool([good, bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}") and message in err


def test_a_pytorch_log_cut_off_mid_run_is_unfinished(tmp_path, capsys):
    rng = np.random.default_rng()
    good = write_torch_log(tmp_path / "good.txt", random_curve(rng))
    bad = write_torch_log(tmp_path / "bad.txt", random_curve(rng), end="mid_run")
    run = parse_log(bad)
    assert run.status == "truncated" and run.last_line == "step:21/" and run.last_step == 20
    assert run.train_time_ms == 1200.0 and run.timed_steps == 10 and run.peak_memory_mib is None
    with pytest.raises(LogError, match=r"did not finish \(truncated: killed, or still running, at step 20/40"):
        require_complete(run)
    assert compare.main([good, bad, "--allow-incomplete"]) == 0
    assert "truncated at step 20: partial curve" in capsys.readouterr().out


def random_arithmetic(rng, depth=3):
    if depth == 0 or rng.random() < 0.3:
        return str(rng.integers(1, 100)) if rng.random() < 0.6 else f"{rng.uniform(0.01, 10):.3f}"
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    left = random_arithmetic(rng, depth - 1)
    right = str(rng.integers(0, 3)) if op == "**" else random_arithmetic(rng, depth - 1)
    return f"{'-' if rng.random() < 0.2 else ''}({left} {op} {right})"


def test_hyperparameter_arithmetic_matches_python_on_random_expressions():
    rng = np.random.default_rng()
    for _ in range(300):
        text = random_arithmetic(rng)
        try:
            expected = eval(text)  # our own generated arithmetic: the independent reference
        except ZeroDivisionError:
            continue
        assert simple_value(ast.parse(text, mode="eval").body) == expected, text


def test_pytorch_hyperparameters_are_read_without_executing_anything(tmp_path):
    marker = tmp_path / "executed"
    lines = ("    seq_len = 48*1024 # FlexAttention sequence length\n"
             "    lr: float = -2**-3 # annotated\n"
             "    betas = (0.8, 0.95)\n"
             "    num_iterations = 1750 + 20\n"
             f"    hook = __import__('os').system('touch {marker}') # not a literal: kept as text\n"
             "    big = 9**9**9 # would take forever\n"
             "    def __post_init__(self):\n"
             "        self.x = 1\n")
    run = parse_log(write_torch_log(tmp_path / "t.txt", random_curve(np.random.default_rng()),
                                    hyperparameters=lines))
    hp = run.hyperparameters
    assert (hp["seq_len"], hp["lr"], hp["betas"], hp["num_iterations"]) == (49152, -0.125, [0.8, 0.95], 1770)
    assert isinstance(hp["hook"], Expression) and hp["hook"] == f"__import__('os').system('touch {marker}')"
    assert isinstance(hp["big"], Expression) and "x" not in hp and not marker.exists()


def test_compare_ours_with_a_pytorch_log(tmp_path, capsys):
    rng = np.random.default_rng()
    va, vb = random_curve(rng), random_curve(rng)
    a = write_log(tmp_path / "a.txt", HP, va, 100.0)
    b = write_torch_log(tmp_path / "b.txt", vb, hyperparameters=TORCH_89_HYPERPARAMETERS,  # record 89's names
                        extra_source=TORCH_89_EXTRA_FILE)  # and its helper files after the script
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert f"A: {a} (JAX train_gpt.py log, preset cpu, 40 steps)\nB: {b} (PyTorch speedrun log, 40 steps)\n" in out
    assert "not diffed: A is a JAX train_gpt.py log, B a PyTorch speedrun log (different languages)" in out
    assert "num_scheduled_iterations: A 40, B 25  <- differs\n" in out
    assert "num_extension_iterations: A 0, B 15  <- differs\n" in out
    assert "val_batch_size: A 8192, B 2097152  <- differs\n" in out and "bigram_vocab_size: A 8192, B 377280  <- differs\n" in out
    assert "batch_size: A (absent), B (absent)\n" in out and "vocab_size: A 50257, B (absent)\n" in out
    assert "val_files: A 'data/fineweb10B/fineweb_val_*.bin', B 'data/fineweb10B/fineweb_val_*.bin'\n" in out
    assert "only in B (no counterpart): save_checkpoint\n" in out and "only in A (no counterpart): bos_id," in out
    for step, x, y in zip(range(0, 41, 10), va, vb):
        assert f"{step:>6} {x:>8.4f} {y:>8.4f} {round(y - x, 4):>+8.4f}" in out
    assert "at common fractions" not in out
    assert f"final_val_loss    A {va[-1]:10.4f}   B {vb[-1]:10.4f}" in out
    assert "train_time (ms)   A    4000.00   B    3600.00   B-A    -400.00 (-10.0%)" in out
    assert "timed steps       A         40   B         30   B-A        -10" in out
    assert "compile_s         A       12.3   B        n/a\n" in out
    assert "peak_memory (MiB) A        n/a   B      37653\n" in out
    assert "clock of B (PyTorch): excludes validation and its first 10 steps, which include compilation" in out
    assert "clock of A (JAX): excludes validation; covers every step" in out


def test_compare_runs_of_different_lengths_at_common_fractions(tmp_path, capsys):
    """Against a 2025-01-26-style log: 1770 steps, seq_len 48*1024, no batch size."""
    rng = np.random.default_rng()
    va, vb = random_curve(rng), random_curve(rng, 16)  # val at 0, 125, ..., 1750 and 1770
    a = write_log(tmp_path / "a.txt", HP, va, 100.0)
    b = write_torch_log(tmp_path / "b.txt", vb, N=1770, every=125, hyperparameters=TORCH_0126_HYPERPARAMETERS)
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "batch_size: A (absent), B (absent)\n" in out and "seq_len: A (absent), B 49152\n" in out
    assert "num_iterations: A (absent), B 1770\n" in out  # record 20's name: ours counts in two parts
    assert "tokens_per_s      A      20480   B        n/a\n" in out  # B names no batch size
    assert "== validation loss at common steps\n  step" in out and f"     0 {va[0]:>8.4f} {vb[0]:>8.4f}" in out
    table = out.split("at common fractions of training (A 40 steps, B 1770; linear between logged val steps)\n")[1]
    rows = table.split("\n\n")[0].splitlines()[1:]
    b_steps = [0] + list(range(125, 1770, 125)) + [1770]
    assert len(rows) == 11
    for i, row in enumerate(rows):
        f = i / 10
        x, y = np.interp(f * 40, range(0, 41, 10), va), np.interp(f * 1770, b_steps, vb)
        assert row.split() == [f"{f:.1f}", f"{f * 40:.0f}", f"{x:.4f}", f"{f * 1770:.0f}", f"{y:.4f}", f"{y - x:+.4f}"]


def test_compare_two_pytorch_logs_diffs_their_sources(tmp_path, capsys):
    rng = np.random.default_rng()
    a = write_torch_log(tmp_path / "a.txt", random_curve(rng))
    b = write_torch_log(tmp_path / "b.txt", random_curve(rng, 16), N=1770, every=125,
                        hyperparameters=TORCH_0126_HYPERPARAMETERS)
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "\n-    batch_size = 8*64*1024 # tokens per step\n" in out
    assert "\n+    seq_len = 48*1024 # tokens per GPU\n" in out
    assert "batch_size: 524288 -> (absent)\n" in out and "num_iterations: 40 -> 1770\n" in out
    assert "seq_len: 65536 -> 49152\n" in out and "clock of A (PyTorch)" in out and "clock of B (PyTorch)" in out


# ---- stats

def stats_logs(tmp_path, losses, name="r", writer="ours"):
    """One complete log per final loss (ours: seeds 0, 1, ...)."""
    if writer == "ours":
        return [write_log(tmp_path / f"{name}{i}.txt", dataclasses.replace(HP, seed=i), [10.8, 5, 4, 3.5, x], 100.0 + i)
                for i, x in enumerate(losses)]
    return [write_torch_log(tmp_path / f"{name}{i}.txt", [10.8, 5, 4, 3.5, x], step_ms=120.0 + i)
            for i, x in enumerate(losses)]


@pytest.mark.parametrize("writer", ["ours", "pytorch"])
def test_stats_textbook_t_test(tmp_path, capsys, writer):
    # by hand: mean 3.2776, squared deviations sum 23.2e-6, s = sqrt(23.2e-6 / 4) = 0.0024083,
    # t = (3.2776 - 3.28) / (s / sqrt 5) = -2.2284 with 4 degrees of freedom
    losses = [3.276, 3.279, 3.277, 3.281, 3.275]
    assert stats.main(stats_logs(tmp_path, losses, writer=writer)) == 0
    out = capsys.readouterr().out
    p = scipy_stats.t.cdf(-2.2284, 4)
    kind = {"ours": "JAX train_gpt.py logs", "pytorch": "PyTorch speedrun logs"}[writer]
    # PyTorch: 30 timed steps of 120..124 ms; ours: 40 steps of 100..104 ms
    time = {"ours": "mean 4.08s  std 0.06s", "pytorch": "mean 3.66s  std 0.05s"}[writer]
    assert f"runs: 5 (5 {kind})" in out and "mean 3.2776  std 0.0024" in out and f"training time:  {time}" in out
    assert f"t = -2.228, df = 4, p = {p:.3g}" in out and 0.04 < p < 0.05
    assert "record claim does NOT hold at p<0.01" in out and "not significantly" in out and "note:" not in out
    assert stats.main(stats_logs(tmp_path, losses, "again", writer) + ["--alpha", "0.05"]) == 0
    assert "record claim holds at p<0.05" in capsys.readouterr().out


def test_stats_p_value_matches_a_hand_computed_t_test_on_random_losses(tmp_path, capsys):
    losses = list((3.2787 + np.random.default_rng().normal(0, 0.0018, 8)).round(4))
    assert stats.main(stats_logs(tmp_path, losses)) == 0
    out = capsys.readouterr().out
    n, mean, sd = len(losses), np.mean(losses), np.std(losses, ddof=1)
    p = scipy_stats.t.cdf((mean - 3.28) / (sd / np.sqrt(n)), n - 1)
    assert f"p = {p:.3g}" in out and f"runs: {n}" in out
    assert ("record claim holds at p<0.01" in out) == (p < 0.01)


def test_stats_claim_line_only_when_significant(tmp_path, capsys):
    stats.main(stats_logs(tmp_path, [3.270, 3.272, 3.271, 3.273], "low"))
    assert "record claim holds at p<0.01" in capsys.readouterr().out
    stats.main(stats_logs(tmp_path, [3.279, 3.282, 3.280], "near"))
    out = capsys.readouterr().out
    assert "record claim holds" not in out and "does NOT hold at p<0.01" in out and "not below the target" in out
    assert stats.main(stats_logs(tmp_path, [3.25], "one")) == 0
    out = capsys.readouterr().out
    assert "no t-test" in out and "record claim" not in out
    assert stats.main(stats_logs(tmp_path, [3.25, 3.25], "same")) == 0
    out = capsys.readouterr().out
    assert "t-test is undefined" in out and "vary --seed" in out and "record claim" not in out


def test_no_record_claim_from_a_repeated_seed_or_synthetic_shards(tmp_path, capsys):
    """Losses far below the target, but: seed 1 twice (a rerun is no new sample: counted as two, it
    would shrink p), or synthetic shards (data/synthetic.py's: nothing about FineWeb)."""
    low = [3.270, 3.272, 3.271, 3.273]
    rerun = [write_log(tmp_path / f"s{i}.txt", dataclasses.replace(HP, seed=seed), [10.8, 5, 4, 3.5, x], 100.0)
             for i, (seed, x) in enumerate(zip([0, 1, 1, 2], low))]
    assert stats.main(rerun) == 0
    out = capsys.readouterr().out
    assert "record claim holds" not in out and f"record claim does NOT hold: seed 1 ran 2 times ({rerun[1]}, " \
                                                f"{rerun[2]}): a rerun of a seed is not an independent sample" in out
    synthetic = dataclasses.replace(HP, train_files="data/synthetic/synthetic_train_*.bin",
                                    val_files="data/synthetic/synthetic_val_*.bin")
    fake = [write_log(tmp_path / f"y{i}.txt", dataclasses.replace(synthetic, seed=i), [10.8, 5, 4, 3.5, x],
                      100.0 + i) for i, x in enumerate(low)]
    assert stats.main(fake) == 0
    out = capsys.readouterr().out
    assert "record claim holds" not in out and "p = " in out  # the test itself is still shown
    assert f"record claim does NOT hold: 4 run(s) trained or validated on synthetic shards (e.g. {fake[0]})" in out
    other_glob = dataclasses.replace(HP, train_files="data/synthetic/*train*.bin")  # its default folder, any glob
    assert stats.claim_problems([parse_log(write_log(tmp_path / "g.txt", other_glob, [10.8, 5, 4, 3.5, 3.2], 100.0))])
    elsewhere = dataclasses.replace(HP, train_files="data/nonsynthetic/fineweb_train_*.bin")  # FineWeb's names
    assert stats.main([write_log(tmp_path / f"n{i}.txt", dataclasses.replace(elsewhere, seed=i), [10.8, 5, 4, 3.5, x],
                                 100.0 + i) for i, x in enumerate(low)]) == 0
    assert "record claim holds at p<0.01" in capsys.readouterr().out
    # and a comparison of groups on other validation shards says they are not comparable
    assert stats.main(stats_logs(tmp_path, [3.275, 3.278, 3.276, 3.279], "f") + ["--against", *fake]) == 0
    assert ("note: the two groups differ in val_files (data/fineweb10B/fineweb_val_*.bin vs "
            "data/synthetic/synthetic_val_*.bin), train data (not synthetic vs synthetic): their losses are not "
            "comparable") in capsys.readouterr().out
    # record 89's script names its shards by an expression (os.path.join(data_path, ...)): no note for that
    script = TORCH_89_HYPERPARAMETERS.replace('"data/fineweb10B/fineweb_val_*.bin"',
                                              'os.path.join(data_path, "data/fineweb10B/fineweb_val_*.bin")')
    torch = [write_torch_log(tmp_path / f"t{i}.txt", [10.8, 5, 4, 3.5, x], step_ms=120.0 + i, hyperparameters=script)
             for i, x in enumerate([3.277, 3.279, 3.278])]
    assert stats.main(stats_logs(tmp_path, [3.275, 3.278, 3.276, 3.279], "g") + ["--against", *torch]) == 0
    out = capsys.readouterr().out
    assert "Welch's t-test" in out and "differ in" not in out


def test_stats_without_scipy_gives_t_but_no_claim(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # makes `from scipy import stats` raise ImportError
    ours = stats_logs(tmp_path, [3.276, 3.279, 3.277, 3.281, 3.275])
    assert stats.main(ours + ["--against"] + stats_logs(tmp_path, [3.28, 3.281], "t", "pytorch")) == 0
    out = capsys.readouterr().out
    assert "t = -2.228 (df 4); the p-value, and so the record claim, needs scipy: pip install scipy" in out
    assert "record claim holds" not in out and "the p-value needs scipy" in out and "below the --against" not in out


def test_stats_notes_runs_of_different_configurations(tmp_path, capsys):
    rng = np.random.default_rng()
    logs = [write_log(tmp_path / f"{i}.txt", dataclasses.replace(HP, seed=i, muon_lr=lr), random_curve(rng), 100.0)
            for i, lr in enumerate([0.05, 0.05, 0.07])]
    stats.main(logs)
    assert "note: the runs differ in hyperparameters (muon_lr)" in capsys.readouterr().out
    stats.main(logs[:2])
    assert "note:" not in capsys.readouterr().out  # the seed may differ
    torch_logs = stats_logs(tmp_path, [3.28, 3.27, 3.29], "t", "pytorch")
    assert stats.main(logs[:2] + torch_logs) == 0
    out = capsys.readouterr().out
    assert "runs: 5 (2 JAX train_gpt.py logs, 3 PyTorch speedrun logs)" in out
    assert "note: the runs differ in language (2 JAX train_gpt.py logs, 3 PyTorch speedrun logs)" in out


def test_stats_welch_test_of_our_runs_against_a_pytorch_record(tmp_path, capsys):
    rng = np.random.default_rng()
    ours = list((3.2760 + rng.normal(0, 0.002, 6)).round(4))
    theirs = list((3.2788 + rng.normal(0, 0.0015, 9)).round(4))
    assert stats.main(stats_logs(tmp_path, ours) + ["--against"] + stats_logs(tmp_path, theirs, "t", "pytorch")) == 0
    out = capsys.readouterr().out
    va, vb = np.var(ours, ddof=1) / 6, np.var(theirs, ddof=1) / 9
    t = (np.mean(ours) - np.mean(theirs)) / np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / 5 + vb**2 / 8)
    p = scipy_stats.t.cdf(t, df)
    assert "--against runs: 9 (9 PyTorch speedrun logs)" in out and "runs: 6 (6 JAX train_gpt.py logs)" in out
    assert f"mean {np.mean(theirs):.4f}" in out
    assert f"Welch's t-test, H1: mean final val loss of the runs < that of the --against runs: t = {t:.3f}, " \
           f"df = {df:.1f}, p = {p:.3g}" in out
    assert ("is below the --against runs' at p<0.01" in out) == (p < 0.01)
    assert ("is NOT shown below" in out) == (p >= 0.01)


def test_stats_welch_claims_only_what_the_data_show(tmp_path, capsys):
    low, high = [3.270, 3.271, 3.272, 3.270], [3.280, 3.281, 3.279, 3.282]
    stats.main(stats_logs(tmp_path, low, "a") + ["--against"] + stats_logs(tmp_path, high, "b", "pytorch"))
    assert "the runs' mean final val loss is below the --against runs' at p<0.01" in capsys.readouterr().out
    stats.main(stats_logs(tmp_path, high, "c") + ["--against"] + stats_logs(tmp_path, low, "d", "pytorch"))
    assert "NOT shown below the --against runs' at p<0.01" in capsys.readouterr().out
    stats.main(stats_logs(tmp_path, low, "e") + ["--against"] + stats_logs(tmp_path, [3.28], "f", "pytorch"))
    assert "Welch's t-test needs at least 2 runs in each group" in capsys.readouterr().out


def test_stats_the_same_log_twice_counts_once(tmp_path, capsys):
    logs = stats_logs(tmp_path, [3.276, 3.279, 3.277])
    shutil.copy(logs[0], tmp_path / "copy.txt")
    assert stats.main(logs + [logs[1], str(tmp_path / "copy.txt")]) == 0
    out = capsys.readouterr().out
    assert f"note: {logs[1]} is the same log as {logs[1]}: counted once" in out
    assert f"note: {tmp_path / 'copy.txt'} is the same log as {logs[0]}: counted once" in out
    assert "runs: 3 " in out and "df = 2" in out
    assert stats.main(logs[:2] + ["--against", logs[1], logs[2]]) == 2
    assert f"error: {logs[1]} is both among the runs and in --against" in capsys.readouterr().err


def test_stats_skip_incomplete_says_what_it_skipped(tmp_path, capsys):
    rng = np.random.default_rng()
    logs = stats_logs(tmp_path, [3.276, 3.279, 3.277])
    cut = write_torch_log(tmp_path / "cut.txt", random_curve(rng), end="mid_run")
    stopped = write_log(tmp_path / "stopped.txt", HP, random_curve(rng), 100.0, end="stopped")
    assert stats.main(logs + [cut]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {cut}: the run did not finish")
    assert "(--skip-incomplete leaves unfinished runs out)" in err
    assert stats.main(logs + [cut, stopped, "--skip-incomplete"]) == 0
    out = capsys.readouterr().out
    assert f"skipped {cut}: the run did not finish (truncated at step 20/40)" in out
    assert f"skipped {stopped}: the run did not finish (stopped at step 20/40)" in out
    assert "runs: 3 (3 JAX train_gpt.py logs)" in out and "df = 2" in out
    assert stats.main([cut, stopped, "--skip-incomplete"]) == 2
    assert "no finished run among" in capsys.readouterr().err


# ---- bad input, scripts

def bad_log(tmp_path, kind):
    """A file that is not a usable log, and what its error message must say."""
    rng = np.random.default_rng()
    good = write_log(tmp_path / "good.txt", HP, random_curve(rng), 100.0)
    with open(good) as f:
        text = f.read()
    bad = tmp_path / "bad.txt"
    if kind == "not_a_log":
        bad.write_text("\n".join("".join(rng.choice(list("ab =:/09\t"), 60)) for _ in range(40)))
    elif kind in ("interrupted", "stopped"):
        write_log(bad, HP, random_curve(rng), 100.0, end=kind)
    elif kind == "truncated":  # killed mid-line
        bad.write_text(text[: text.index("step:25/40") + 8])
    elif kind == "cut_in_source":
        bad.write_text(text[: text.index("def train(")])
    elif kind == "cut_in_environment":
        bad.write_text(text[: text.index("Devices: 1 x")])
    elif kind == "cut_in_header":
        bad.write_text(text[: text.rindex("Hyperparameters (preset") + 40])
    elif kind == "bad_json":
        assert '"muon_lr": 0.023,' in text
        bad.write_text(text.replace('"muon_lr": 0.023,', '"muon_lr": 0.023,,'))
    elif kind == "bad_torch_source":
        write_torch_log(bad, random_curve(rng), hyperparameters="    x = (1,\n")
    return good, str(bad), {
        "not_a_log": "is not a record log of train_gpt.py or of the PyTorch speedrun",
        "interrupted": r"did not finish \(interrupted, at step 20/40; last line: 'interrupted at step 20 \(SIGINT\)'\)",
        "stopped": r"did not finish \(stopped, at step 20/40; last line: 'stopped: non-finite train loss nan",
        "truncated": r"did not finish \(truncated: killed, or still running, at step 24/40; last line: 'step:25/'\)",
        "cut_in_source": "is cut off inside its embedded source",
        "cut_in_environment": "is cut off in its header, in the environment block",
        "cut_in_header": "cut off in its header, before the end of the hyperparameters block",
        "bad_json": "hyperparameters block is not valid JSON",
        "bad_torch_source": r"the embedded source is not valid Python \(line \d+: ",
    }[kind]


@pytest.mark.parametrize("kind", ["not_a_log", "truncated", "interrupted", "stopped", "cut_in_source",
                                  "cut_in_environment", "cut_in_header", "bad_json", "bad_torch_source"])
def test_bad_logs_are_rejected_with_a_message_and_exit_code_2(tmp_path, capsys, kind):
    good, bad, message = bad_log(tmp_path, kind)
    with open(good) as f:
        before = f.read()
    for tool in (lambda: compare.main([good, bad]), lambda: stats.main([good, bad])):
        assert tool() == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}") and re.search(message, err)
        if kind in ("truncated", "interrupted", "stopped"):
            assert "only complete runs can be compared or tested" in err
    with pytest.raises(LogError, match=message):
        require_complete(parse_log(bad))
    with open(good) as f:
        assert f.read() == before  # the tools only read


def test_the_tools_run_as_scripts_from_the_repo_root_without_jax(tmp_path):
    good, bad, _ = bad_log(tmp_path, "interrupted")
    ok = subprocess.run([sys.executable, "records/compare.py", good, good], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and "sources identical" in ok.stdout and "note: A and B are the same log" in ok.stdout
    fail = subprocess.run([sys.executable, "records/stats.py", good, bad], cwd=ROOT, capture_output=True, text=True)
    assert fail.returncode == 2 and "interrupted" in fail.stderr and "Traceback" not in fail.stderr
    logs = subprocess.run([sys.executable, "records/logs.py", good, bad, "nope.txt"], cwd=ROOT, capture_output=True,
                          text=True)
    assert logs.returncode == 2 and "nope.txt" in logs.stderr and "Traceback" not in logs.stderr
    assert re.search(r"good\.txt: JAX train_gpt.py log, preset cpu, 40 steps, complete at step 40; final val_loss .*\n"
                     r"  stage 0 \(\d[\d,]* tokens a step\): 100\.00 ms, \d+ tokens/s over steps 2-9, 12\n",
                     logs.stdout), logs.stdout
    assert "interrupted at step 20" in logs.stdout
    folder = subprocess.run([sys.executable, "records/logs.py", str(tmp_path)], cwd=ROOT, capture_output=True,
                            text=True)  # a folder stands for its logs, as in stats.py
    assert folder.returncode == 0 and folder.stdout.count(": JAX train_gpt.py log") == 2, folder.stdout + folder.stderr
    probe = ("import sys; sys.argv = ['x', sys.argv[1], sys.argv[1]]; import records.compare as c, records.stats as s; "
             "c.main(); s.main(); assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]")
    nojax = subprocess.run([sys.executable, "-c", probe, good], cwd=ROOT, capture_output=True, text=True)
    assert nojax.returncode == 0, nojax.stderr


# ---- what users met (a review, 2026-11-28): line ends, a diverged PyTorch run, --plot paths, pipes

def test_a_log_copied_with_windows_line_ends_reads_the_same(tmp_path):
    rng = np.random.default_rng()
    for name, path in (("ours", write_log(tmp_path / "o.txt", HP, random_curve(rng), 100.0)),
                       ("pytorch", write_torch_log(tmp_path / "t.txt", random_curve(rng)))):
        crlf = tmp_path / f"{name}_crlf.txt"
        with open(path, "rb") as f:
            crlf.write_bytes(f.read().replace(b"\n", b"\r\n"))
        a, b = parse_log(path), parse_log(str(crlf))
        assert b.status == "complete" and b.layout == a.layout and b.source == a.source, name
        assert b.digest == a.digest, name  # a copy counts once
        assert repr((b.val_curve, b.train_steps, b.hyperparameters, b.environment)) == repr(  # (nan != nan)
            (a.val_curve, a.train_steps, a.hyperparameters, a.environment)), name


def test_a_pytorch_run_whose_final_val_loss_is_nan_is_a_failed_run(tmp_path, capsys):
    """The PyTorch script trains on after a NaN, so a diverged run's log ends as a finished one's."""
    good = stats_logs(tmp_path, [3.270, 3.271, 3.272], writer="pytorch")
    diverged = write_torch_log(tmp_path / "nan.txt", [10.8, 5, 4, float("nan"), float("nan")])
    run = parse_log(diverged)
    assert run.status == "stopped" and not run.finished and math.isnan(run.val_curve[-1][1])
    assert stats.main(good + [diverged]) == 2
    err = capsys.readouterr().err
    assert f"error: {diverged}: the run did not finish (stopped, at step 40/40; its final val_loss is nan: it " \
           f"diverged)" in err
    assert stats.main(good + [diverged, "--skip-incomplete"]) == 0
    out = capsys.readouterr().out
    assert f"record claim does NOT hold: 1 run(s) failed ({diverged})" in out
    assert logs_main([diverged]) == 0  # logs.py says why it stopped
    assert "stopped at step 40; its final val_loss is nan: it diverged; train_time" in capsys.readouterr().out
    ours = write_log(tmp_path / "ours_nan.txt", HP, random_curve(np.random.default_rng()), 100.0, end="stopped")
    assert logs_main([ours]) == 0 and "stopped at step 20; stopped: non-finite train loss nan at step 20; " \
        in capsys.readouterr().out
    png = tmp_path / "nan.png"  # its finite points drawn, the NaN ones left out
    assert compare.main([diverged, good[0], "--allow-incomplete", "--plot", str(png)]) == 0
    fig = compare.plot(parse_log(diverged), parse_log(good[0]), str(png))
    assert list(fig.axes[0].lines[0].get_xdata()) == [0, 10, 20]


@pytest.mark.parametrize("tool", ["stats", "compare"])
def test_a_plot_path_that_cannot_be_written_is_refused_before_any_work(tool, tmp_path, capsys, monkeypatch):
    log = stats_logs(tmp_path, [3.27, 3.28])
    run = {"stats": lambda extra: stats.main(log + extra), "compare": lambda extra: compare.main(log + extra)}[tool]
    for path, message in ((tmp_path / "missing" / "x.png", f"--plot {tmp_path / 'missing' / 'x.png'}: "
                           f"{tmp_path / 'missing'} is no folder this user can write to"),
                          (tmp_path / "x.xyz", "'xyz' is not a format matplotlib writes; name the file .png"),
                          (tmp_path / "x", "a file name without an extension is not a format matplotlib writes"),
                          (tmp_path / "d.png", f"--plot {tmp_path / 'd.png'} is a folder: give a file name")):
        if path.name == "d.png":
            path.mkdir()
        with pytest.raises(SystemExit) as e:
            run(["--plot", str(path)])
        assert e.value.code == 2 and message in capsys.readouterr().err
        assert not path.exists() or path.is_dir()
    assert run(["--plot", str(tmp_path / "x.svg")]) == 0 and (tmp_path / "x.svg").read_bytes()[:5] in (b"<?xml", b"<svg ")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: said before any work, exit 2
    assert run(["--plot", str(tmp_path / "y.png")]) == 2 and not (tmp_path / "y.png").exists()
    extras = {"stats": "matplotlib and scipy, optional extras", "compare": "matplotlib, an optional extra"}[tool]
    assert f"error: --plot needs {extras} (" in capsys.readouterr().err


def test_a_reader_that_leaves_the_pipe_early_is_no_error(tmp_path):
    """`compare.py A B | head` (its source diff is long), `logs.py DIR | head`: no traceback, exit 0."""
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    b = write_log(tmp_path / "b.txt", hp_with(40, muon_lr=0.05), random_curve(rng), 100.0)
    for i in range(3):
        write_log(tmp_path / f"c{i}.txt", HP, random_curve(rng), 100.0)
    with open(b) as f:
        text = f.read()
    with open(b, "w") as f:
        f.write(text.replace("def ", "def  ", 400))  # a diff of hundreds of lines
    for tool, args in (("compare.py", [a, b]), ("logs.py", [str(tmp_path)] * 400)):
        cmd = " ".join([shlex.quote(sys.executable), f"records/{tool}", *map(shlex.quote, args)]) + " | head -n 1"
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0 and r.stderr == "" and r.stdout.count("\n") == 1, (tool, r.returncode, r.stderr[-500:])


def test_targets_and_levels_that_test_nothing_are_refused(capsys):
    for args, message in ((["--target", "nan"], "--target must be a finite val loss (got 'nan')"),
                          (["--target", "inf"], "--target must be a finite val loss"),
                          (["--alpha", "0.6"], "--alpha must be a significance level between 0 and 0.5 (got '0.6')")):
        with pytest.raises(SystemExit) as e:
            stats.main(["x.txt", *args])
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main(["x.txt", "y.txt", "--target", "nan"])
    assert "--target must be a finite val loss" in capsys.readouterr().err


def test_a_glob_skips_the_attempts_verdicts_and_compare_says_it_takes_two_files(tmp_path, capsys):
    logs = stats_logs(tmp_path, [3.27, 3.28, 3.275])
    (tmp_path / "attempt_20261128_x.verdict").write_text("runs: 3 ...\n")
    assert stats.main([str(tmp_path / "*")]) == 0 and "runs: 3 " in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        compare.main([str(tmp_path / "*.txt"), logs[0]])
    assert e.value.code == 2
    assert f"{tmp_path / '*.txt'} is a pattern: compare.py takes two log files" in capsys.readouterr().err
