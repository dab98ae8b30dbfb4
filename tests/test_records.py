"""records/: compare and stats on logs written with train_gpt.py's own log writer."""
import dataclasses
import re

import matplotlib.image
import numpy as np
import pytest
from scipy import stats as scipy_stats

import train_gpt as tg
from records import compare, stats
from records.logs import LogError, parse_log, require_complete


def write_log(path, hp, val_losses, step_ms, end="complete"):
    """A log as train() writes it: header, compile line, val and train lines, summary, last line."""
    log = tg.RecordLog(str(path), quiet=True)
    tg.log_header(log, hp, "cpu")
    log.write("compile: 12.3s for the train and validation steps (persistent cache: off)")
    N, every = hp.num_iterations, hp.val_loss_every
    train_ms, val = 0.0, iter(val_losses)
    for step in range(N + 1):
        if step == N or step % every == 0:
            val_loss = next(val)
            log.write(tg.val_line(step, N, val_loss, train_ms))
        if step == N:
            break
        if end == "interrupted" and step == N // 2:
            log.write(f"interrupted at step {step} (SIGINT)")
            return str(path)
        train_ms += step_ms
        log.write(tg.train_line(step + 1, N, train_ms))
    if end == "complete":
        log.write(tg.summary_line({"final_val_loss": val_loss, "train_time_ms": train_ms, "step_avg_ms": train_ms / N,
                                   "tokens_per_s": N * hp.batch_size / train_ms * 1000, "compile_s": 12.3,
                                   "peak_memory_mib": None}))
        log.write("run complete")
    log.close()
    return str(path)


HP = dataclasses.replace(tg.PRESETS["cpu"], num_iterations=40, val_loss_every=10)


def random_curve(rng):
    return list(np.sort(rng.uniform(3, 10, 5))[::-1].round(4))


def test_compare_shows_the_changed_hyperparameter_and_curve_differences(tmp_path, capsys):
    rng = np.random.default_rng()
    va, vb = random_curve(rng), random_curve(rng)
    a = write_log(tmp_path / "a.txt", HP, va, step_ms=100.0)
    b = write_log(tmp_path / "b.txt", dataclasses.replace(HP, muon_lr=0.07), vb, step_ms=90.0)
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "muon_lr: 0.05 -> 0.07" in out
    assert "sources identical" in out
    for step, x, y in zip(range(0, 41, 10), va, vb):
        assert f"{step:>6} {x:>8.4f} {y:>8.4f} {y - x:>+8.4f}" in out
    assert "step_avg (ms)    A     100.00   B      90.00   B-A     -10.00 (-10.0%)" in out


def test_compare_plot_is_a_png_with_both_runs_and_the_baseline(tmp_path):
    rng = np.random.default_rng()
    a = write_log(tmp_path / "a.txt", HP, random_curve(rng), 100.0)
    b = write_log(tmp_path / "b.txt", HP, random_curve(rng), 100.0)
    out = tmp_path / "cmp.png"
    assert compare.main([a, b, "--plot", str(out), "--baseline", "record20"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(str(out)).shape[2] in (3, 4)
    fig = compare.plot(parse_log(a), parse_log(b), str(out))
    assert [len(ax.lines) for ax in fig.axes] == [2, 2]  # two runs in each panel
    assert compare.load_baseline("record20")[-1] == (1393, 3.2785, 179527.0)


def test_stats_p_value_matches_an_independent_t_test(tmp_path, capsys):
    rng = np.random.default_rng()
    losses = list((3.2787 + rng.normal(0, 0.0018, 8)).round(4))
    logs = [write_log(tmp_path / f"{i}.txt", HP, [10.8, 5, 4, 3.5, loss], 100.0) for i, loss in enumerate(losses)]
    assert stats.main(logs) == 0
    out = capsys.readouterr().out
    n, mean, sd = len(losses), np.mean(losses), np.std(losses, ddof=1)
    t = (mean - 3.28) / (sd / np.sqrt(n))
    p = scipy_stats.t.cdf(t, n - 1)  # by hand from the t distribution
    assert f"p = {p:.3g}" in out and f"runs: {n}" in out
    assert abs(float(re.search(r"final val loss: mean (\S+)", out)[1]) - mean) <= 5e-5
    assert ("record claim holds at p<0.01" in out) == (p < 0.01)


def test_stats_claim_line_only_when_significant(tmp_path, capsys):
    # textbook check: losses 3.270, 3.272, ... clearly below 3.28 -> claim; around 3.28 -> no claim
    low = [write_log(tmp_path / f"l{i}.txt", HP, [10, 5, 4, 3.5, x], 100.0) for i, x in enumerate([3.270, 3.272, 3.271, 3.273])]
    stats.main(low)
    assert "record claim holds at p<0.01" in capsys.readouterr().out
    near = [write_log(tmp_path / f"n{i}.txt", HP, [10, 5, 4, 3.5, x], 100.0) for i, x in enumerate([3.279, 3.282, 3.280])]
    stats.main(near)
    out = capsys.readouterr().out
    assert "record claim holds" not in out and "does NOT hold" in out


@pytest.mark.parametrize("kind", ["not_a_log", "truncated", "interrupted", "cut_in_header"])
def test_bad_logs_are_rejected(tmp_path, capsys, kind):
    rng = np.random.default_rng()
    good = write_log(tmp_path / "good.txt", HP, random_curve(rng), 100.0)
    bad = tmp_path / "bad.txt"
    if kind == "not_a_log":
        bad.write_text("hello\nworld\n")
    elif kind == "interrupted":
        write_log(bad, HP, random_curve(rng), 100.0, end="interrupted")
    else:
        text = open(good).read()
        cut = text.index("step:20/40") if kind == "truncated" else text.rindex("Hyperparameters (preset") + 40
        bad.write_text(text[:cut])
    for tool in (lambda: compare.main([good, str(bad)]), lambda: stats.main([good, str(bad)])):
        assert tool() == 2
        err = capsys.readouterr().err
        assert "bad.txt" in err
    with pytest.raises(LogError, match={"not_a_log": "not a train_gpt.py record log", "truncated": "truncated",
                                        "interrupted": "interrupted", "cut_in_header": "cut off"}[kind]):
        require_complete(parse_log(str(bad)))
