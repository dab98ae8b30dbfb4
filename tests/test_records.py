"""records/: the parser, compare and stats, on logs written with train_gpt.py's own log writer."""
import dataclasses
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import stats as scipy_stats  # noqa: E402

import train_gpt as tg  # noqa: E402
from records import compare, stats  # noqa: E402
from records.logs import LogError, parse_log, require_complete  # noqa: E402

HP = dataclasses.replace(tg.PRESETS["cpu"], num_iterations=40, val_loss_every=10)


def write_log(path, hp, val_losses, step_ms, end="complete"):
    """A log as train() writes it: header, info and compile lines, a val line every val_loss_every
    steps and at the end, a train line per step, then the summary and `run complete` (or, for
    end="interrupted"/"stopped", the line train() writes when that happens half-way)."""
    log = tg.RecordLog(str(path), quiet=True)
    tg.log_header(log, hp, "cpu")
    N, every = hp.num_iterations, hp.val_loss_every
    log.write(f"preset cpu: {N} steps x {hp.batch_size} tokens, 1 device(s); log {path}")
    log.write("compile: 12.3s for the train and validation steps (persistent cache: off)")
    train_ms, val = 0.0, iter(val_losses)
    for step in range(N + 1):
        if step == N or step % every == 0:
            val_loss = next(val)
            log.write(tg.val_line(step, N, val_loss, train_ms))
        if step == N:
            break
        if step == N // 2 and end != "complete":
            log.write({"interrupted": f"interrupted at step {step} (SIGINT)",
                       "stopped": f"stopped: non-finite train loss nan at step {step}"}[end])
            break
        train_ms += step_ms
        log.write(tg.train_line(step + 1, N, train_ms))
    if end == "complete":
        log.write(tg.summary_line({"final_val_loss": val_loss, "train_time_ms": train_ms, "step_avg_ms": train_ms / N,
                                   "tokens_per_s": N * hp.batch_size / train_ms * 1000, "compile_s": 12.3,
                                   "peak_memory_mib": None}))
        log.write("run complete")
    log.close()
    return str(path)


def random_curve(rng):
    """Five decreasing val losses (steps 0, 10, 20, 30, 40)."""
    return list(np.sort(rng.uniform(3, 10, 5))[::-1].round(4))


def test_parse_log_reads_what_the_writer_wrote(tmp_path):
    curve = random_curve(np.random.default_rng())
    run = require_complete(parse_log(write_log(tmp_path / "a.txt", HP, curve, 100.0)))
    with open(tg.__file__) as f:
        assert run.source == f.read()
    assert run.environment[0].startswith("Running Python") and run.preset == "cpu"
    assert run.hyperparameters == dataclasses.asdict(HP)
    assert run.val_curve == [(s, v, 100.0 * s) for s, v in zip(range(0, 41, 10), curve)]
    assert run.train_steps[-1] == (40, 4000.0, 100.0) and len(run.train_steps) == 40
    assert run.compile_s == 12.3 and run.final_val_loss == curve[-1] and run.summary["peak_memory_mib"] is None


def test_a_rule_and_step_lines_inside_the_embedded_source_do_not_confuse_the_parser(tmp_path):
    good = write_log(tmp_path / "a.txt", HP, random_curve(np.random.default_rng()), 100.0)
    fake = "\n".join([tg.RULE, "Hyperparameters (preset fake):", "{}", tg.RULE, tg.val_line(7, 9, 1.0, 5.0), ""])
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
    assert "sources identical" in out
    assert re.search(r"== hyperparameters\nmuon_lr: 0.05 -> 0.07\n\n", out)  # only the changed key
    for step, x, y in zip(range(0, 41, 10), va, vb):
        assert f"{step:>6} {x:>8.4f} {y:>8.4f} {round(y - x, 4):>+8.4f}" in out
    assert "step_avg (ms)    A     100.00   B      90.00   B-A     -10.00 (-10.0%)" in out
    assert "train_time (ms)  A    4000.00   B    3600.00   B-A    -400.00 (-10.0%)" in out
    assert f"final_val_loss   A {va[-1]:10.4f}   B {vb[-1]:10.4f}" in out


def test_compare_diffs_the_embedded_sources(tmp_path, capsys):
    a = write_log(tmp_path / "a.txt", HP, random_curve(np.random.default_rng()), 100.0)
    with open(a) as f:
        text = f.read()
    (tmp_path / "b.txt").write_text(text.replace("ATTN_SCALE = 0.12\n", "ATTN_SCALE = 0.15\n", 1))
    assert compare.main([a, str(tmp_path / "b.txt")]) == 0
    out = capsys.readouterr().out
    assert f"--- {a}\n+++ {tmp_path / 'b.txt'}\n" in out
    assert "\n-ATTN_SCALE = 0.12\n+ATTN_SCALE = 0.15\n" in out and "hyperparameters identical" in out


def test_compare_plot_is_a_png_with_both_runs_and_the_baseline(tmp_path, capsys):
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    b = write_log(tmp_path / "b.txt", HP, random_curve(rng), 100.0)
    out = tmp_path / "cmp.png"
    assert compare.main([a, b, "--plot", str(out), "--baseline", "record20"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(out)).shape[2] in (3, 4)
    assert "  record20" in capsys.readouterr().out  # the table's baseline column
    baseline = compare.load_baseline("record20")
    assert baseline[0] == (0, 10.8258, 0.0) and baseline[-1] == (1393, 3.2785, 179527.0) and len(baseline) == 13
    fig = compare.plot(parse_log(a), parse_log(b), str(out), baseline, "record20")
    assert [len(ax.lines) for ax in fig.axes] == [3, 3]  # two runs and the baseline, in each panel
    assert list(fig.axes[0].lines[0].get_ydata()) == [v for _, v, _ in parse_log(a).val_curve]


def test_compare_plot_without_matplotlib_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert compare.main([a, a, "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_compare_allow_incomplete_shows_the_partial_curve(tmp_path, capsys):
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    b = write_log(tmp_path / "b.txt", HP, random_curve(rng), 100.0, end="interrupted")
    assert compare.main([a, b, "--allow-incomplete"]) == 0
    out = capsys.readouterr().out
    assert "interrupted at step 20: partial curve" in out
    table = out.split("== validation loss\n")[1].split("\n\n")[0].splitlines()
    assert [int(row.split()[0]) for row in table[1:]] == [0, 10, 20]  # the common steps


def stats_logs(tmp_path, losses, name="r"):
    """One complete log per final loss."""
    return [write_log(tmp_path / f"{name}{i}.txt", HP, [10.8, 5, 4, 3.5, x], 100.0 + i) for i, x in enumerate(losses)]


def test_stats_textbook_t_test(tmp_path, capsys):
    # by hand: mean 3.2776, squared deviations sum 23.2e-6, s = sqrt(23.2e-6 / 4) = 0.0024083,
    # t = (3.2776 - 3.28) / (s / sqrt 5) = -2.2284 with 4 degrees of freedom
    losses = [3.276, 3.279, 3.277, 3.281, 3.275]
    assert stats.main(stats_logs(tmp_path, losses)) == 0
    out = capsys.readouterr().out
    p = scipy_stats.t.cdf(-2.2284, 4)
    assert "runs: 5" in out and "mean 3.2776  std 0.0024" in out and "training time:  mean 4.08s  std 0.06s" in out
    assert f"t = -2.228, df = 4, p = {p:.3g}" in out and 0.04 < p < 0.05
    assert "record claim does NOT hold at p<0.01" in out and "not significantly" in out
    assert stats.main(stats_logs(tmp_path, losses, "again") + ["--alpha", "0.05"]) == 0
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


def test_stats_without_scipy_gives_t_but_no_claim(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy", None)  # makes `from scipy import stats` raise ImportError
    assert stats.main(stats_logs(tmp_path, [3.276, 3.279, 3.277, 3.281, 3.275])) == 0
    out = capsys.readouterr().out
    assert "t = -2.228 (df 4); the p-value, and so the record claim, needs scipy: pip install scipy" in out
    assert "record claim holds" not in out


def test_stats_notes_runs_of_different_configurations(tmp_path, capsys):
    rng = np.random.default_rng()
    logs = [write_log(tmp_path / f"{i}.txt", dataclasses.replace(HP, seed=i, muon_lr=lr), random_curve(rng), 100.0)
            for i, lr in enumerate([0.05, 0.05, 0.07])]
    stats.main(logs)
    assert "note: the runs differ in hyperparameters (muon_lr)" in capsys.readouterr().out
    stats.main(logs[:2])
    assert "note:" not in capsys.readouterr().out  # the seed may differ


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
    elif kind == "cut_in_header":
        bad.write_text(text[: text.rindex("Hyperparameters (preset") + 40])
    elif kind == "bad_json":
        bad.write_text(text.replace('"muon_lr": 0.05,', '"muon_lr": 0.05,,'))
    return good, str(bad), {
        "not_a_log": "is not a train_gpt.py record log",
        "interrupted": r"did not finish \(interrupted, at step 20/40; last line: 'interrupted at step 20 \(SIGINT\)'\)",
        "stopped": r"did not finish \(stopped, at step 20/40; last line: 'stopped: non-finite train loss nan",
        "truncated": r"did not finish \(truncated: killed, or still running, at step 24/40; last line: 'step:25/'\)",
        "cut_in_header": "cut off in its header",
        "bad_json": "hyperparameters block is not valid JSON",
    }[kind]


@pytest.mark.parametrize("kind", ["not_a_log", "truncated", "interrupted", "stopped", "cut_in_header", "bad_json"])
def test_bad_logs_are_rejected_with_a_message_and_exit_code_2(tmp_path, capsys, kind):
    good, bad, message = bad_log(tmp_path, kind)
    for tool in (lambda: compare.main([good, bad]), lambda: stats.main([good, bad])):
        assert tool() == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}") and re.search(message, err)
        if kind in ("truncated", "interrupted", "stopped"):
            assert "only complete runs can be compared or tested" in err
    with pytest.raises(LogError, match=message):
        require_complete(parse_log(bad))


def test_the_tools_run_as_scripts_from_the_repo_root(tmp_path):
    good, bad, _ = bad_log(tmp_path, "interrupted")
    ok = subprocess.run([sys.executable, "records/compare.py", good, good], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and "sources identical" in ok.stdout
    fail = subprocess.run([sys.executable, "records/stats.py", good, bad], cwd=ROOT, capture_output=True, text=True)
    assert fail.returncode == 2 and "interrupted" in fail.stderr and "Traceback" not in fail.stderr
