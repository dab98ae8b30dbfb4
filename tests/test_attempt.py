"""A record attempt from start to verdict: records/attempt.py (one real 2-run attempt, and stand-in
scripts for failed, bad and interrupted runs), run.sh --runs, and what the verdict adds to
records/stats.py (runs needed, the paired test by seed, the time test) and the plots."""
import dataclasses
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading

import numpy as np
import pytest
from scipy import stats as scipy_stats

from records import attempt, compare, stats
from records.logs import parse_log
from conftest import COMPILE_CACHE, TINY_STEPS
from data.shards import write_shard
from log_writers import HP, NVIDIA_SMI, hp_with, write_log, write_torch_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTEMPT = os.path.join(ROOT, "records", "attempt.py")


def reproduced(verdict_path):
    """(the saved report, what its `reproduce` command prints now)."""
    with open(verdict_path) as f:
        rest = f.read().split("\nreproduce (in ", 1)[1]
    folder, rest = rest.split("): ", 1)
    command, saved = rest.split("\n", 1)
    words = shlex.split(command)
    assert words[:2] == ["python", "records/stats.py"]
    again = subprocess.run([sys.executable, *words[1:]], cwd=folder, capture_output=True, text=True)
    return saved, again.stdout + again.stderr


# ---- one real attempt: 2 runs of train_gpt.py at the tiny settings (conftest's tiny_attempt)

@pytest.mark.heavy(1)
def test_a_two_run_attempt_makes_two_seeded_runs_with_a_tally_after_each(tiny_attempt):
    records, proc = tiny_attempt.records, tiny_attempt.proc
    runs = [parse_log(str(p)) for p in sorted(records.glob("*.txt"))]
    assert len(runs) == 2 and all(r.finished for r in runs)
    assert sorted(r.hyperparameters["seed"] for r in runs) == [0, 1]
    # the other options reached every run
    assert {r.num_iterations for r in runs} == {TINY_STEPS}
    assert proc.stdout.count("\nrun complete\n") == 2  # the runs' own output passed through
    losses = [r.final_val_loss for r in sorted(runs, key=lambda r: r.hyperparameters["seed"])]
    for done in (1, 2):
        assert (f"attempt: {done} of 2 runs done, 0 failed; mean final val loss {statistics.mean(losses[:done]):.4f}"
                in proc.stdout)
    assert proc.stdout.count(" finished; ETA ") == 1 and "2 finished; all done\n" in proc.stdout
    # the second run loads both programs the first compiled into the shared cache, and says so
    second = [line for line in open(tiny_attempt.logs[1]) if line.startswith("compile: ")]
    assert len(second) == 1
    assert second[0].rstrip().endswith(f"(persistent cache: {COMPILE_CACHE}, 2 of 2 loaded from it)")


def test_the_attempts_verdict_covers_exactly_its_runs_and_reproduces(tiny_attempt):
    records, proc = tiny_attempt.records, tiny_attempt.proc
    logs = sorted(str(p) for p in records.glob("*.txt"))
    runs = [parse_log(p) for p in logs]
    (verdict,) = records.glob("attempt_*.verdict")
    text = verdict.read_text()
    assert text in proc.stdout and text.startswith("attempt verdict: python records/attempt.py --runs 2 --seed 0")
    for run in runs:
        seed = run.hyperparameters["seed"]
        assert f"run {seed + 1} (seed {seed}): finished, final val loss {run.final_val_loss:.4f}" in text
    command = text.split("reproduce (in ")[1].split("\n")[0]
    assert [w for w in shlex.split(command) if w.endswith(".txt")] == logs  # exactly these (outside the repo)
    losses = [r.final_val_loss for r in runs]
    assert "runs: 2 (2 JAX train_gpt.py logs)" in text and f"mean {statistics.mean(losses):.4f}" in text
    assert f"spread: std {statistics.stdev(losses):.4f}; record 89's: 0.0014" in text
    assert "record claim does NOT hold" in text  # a tiny run is nowhere near 3.28
    saved, again = reproduced(verdict)
    assert again == saved


# ---- stand-in scripts: a run is a copy of a log written here, chosen by its seed

FAKE_SCRIPT = '''"""A stand-in for train_gpt.py: run of seed S = the log TEMPLATES/S.txt, copied into --records-dir."""
import os, shutil, signal, sys
flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
print("argv:", sys.argv[1:], flush=True)
template = os.path.join(flags["--templates"], flags["--seed"] + ".txt")
if not os.path.exists(template):
    print(f"error: --seed {flags['--seed']}: no such template {template}", file=sys.stderr)
    sys.exit(2)
log = os.path.join(flags["--records-dir"], "run_seed" + flags["--seed"] + ".txt")
shutil.copy(template, log)
if flags.get("--log-line") != "no":
    print("record log: " + os.path.abspath(log), flush=True)
with open(log) as f:
    text = f.read()
if text.endswith("run complete\\n"):
    sys.exit(0)
if "\\nstopped: " in text:
    sys.exit(1)


def interrupted(signum, frame):  # as train_gpt.py does: the log says so, then exit 130
    with open(log, "a") as f:
        f.write("interrupted at step 20 (SIGINT)\\n")
    sys.exit(130)


signal.signal(signal.SIGINT, interrupted)
print("waiting for Ctrl-C", flush=True)
while True:
    signal.pause()
'''


@pytest.fixture
def fake(tmp_path):
    """fake(finished={seed: final loss}, failed=[seeds], waiting=[seeds]) -> (script, templates, records)."""
    def make(finished=(), failed=(), waiting=()):
        templates, records = tmp_path / "templates", tmp_path / "records"
        templates.mkdir()
        records.mkdir()
        for seed, loss in dict(finished).items():
            write_log(templates / f"{seed}.txt", dataclasses.replace(HP, seed=seed), [10.8, 5, 4, 3.5, loss], 100.0)
        for seed in failed:
            write_log(templates / f"{seed}.txt", dataclasses.replace(HP, seed=seed), [10.8, 5, 4], 100.0, end="stopped")
        for seed in waiting:  # cut where SIGINT will write its line
            write_log(templates / f"{seed}.txt", dataclasses.replace(HP, seed=seed), [10.8, 5, 4], 100.0,
                      end="interrupted")
            text = (templates / f"{seed}.txt").read_text()
            (templates / f"{seed}.txt").write_text(text[: text.rindex("interrupted at step")])
        script = tmp_path / "fake_train.py"
        script.write_text(FAKE_SCRIPT)
        return str(script), str(templates), str(records)
    return make


def run_attempt(*args, **kwargs):
    return subprocess.run([sys.executable, ATTEMPT, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, **kwargs)


def test_a_failed_run_is_named_counted_and_voids_the_claim(fake):
    script, templates, records = fake(finished={10: 3.2701, 12: 3.2703}, failed=[11])
    r = run_attempt("--runs", 3, "--seed", 10, "--script", script, "--templates", templates, "--records-dir", records)
    assert r.returncode == 1, r.stderr
    # the other options reached the script unchanged, with the seed appended
    assert f"argv: ['--templates', '{templates}', '--records-dir', '{records}', '--seed', '11']" in r.stdout
    assert "attempt: 2 of 3 runs done, 1 failed; mean final val loss 3.2701 over 1 finished" in r.stdout
    (verdict,) = [p for p in os.listdir(records) if p.endswith(".verdict")]
    text = open(os.path.join(records, verdict)).read()
    assert "run 2 (seed 11): FAILED (exit 1)" in text and "run 3 (seed 12): finished, final val loss 3.2703" in text
    assert "failed: run 2 (seed 11); a record claim cannot hold with failed runs" in text
    assert re.search(r"skipped \S*run_seed11.txt: the run did not finish \(stopped at step 20/40\)", text)
    assert "runs: 2 (2 JAX train_gpt.py logs)" in text and "record claim does NOT hold: 1 run(s) failed" in text
    assert "record claim holds" not in text and "partial" not in text
    saved, again = reproduced(os.path.join(records, verdict))
    assert again == saved


def test_exit_2_from_a_run_stops_the_attempt_at_once(fake):
    script, templates, records = fake(finished={31: 3.27})  # seed 30 has no template: the script exits 2
    r = run_attempt("--runs", 3, "--seed", 30, "--script", script, "--templates", templates, "--records-dir", records)
    assert r.returncode == 2
    assert "error: --seed 30: no such template" in r.stderr  # the script's own message, passed through
    assert "attempt: stopped: run 1 exited 2 (bad flags or data, said above)" in r.stderr
    assert r.stdout.count("argv:") == 1 and "attempt: run 2 of 3" not in r.stdout
    assert os.listdir(records) == [] and "no verdict" in r.stdout


def test_a_script_that_never_prints_its_log_path_is_named(fake):
    script, templates, records = fake(finished={5: 3.27})
    r = run_attempt("--runs", 2, "--seed", 5, "--script", script, "--templates", templates, "--records-dir", records,
                    "--log-line", "no")
    assert r.returncode == 2 and r.stdout.count("argv:") == 1
    assert f"attempt: stopped: {script} finished run 1 without printing a line 'record log: PATH'" in r.stderr
    assert "older than records/attempt.py" in r.stderr


def test_ctrl_c_stops_the_attempt_with_a_partial_verdict(fake):
    script, templates, records = fake(finished={20: 3.2701}, waiting=[21])
    # a session of its own: the signal reaches the driver and its run, as Ctrl-C in a terminal does
    proc = subprocess.Popen([sys.executable, ATTEMPT, "--runs", "3", "--seed", "20", "--script", script, "--templates",
                             templates, "--records-dir", records], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    guard = threading.Timer(60, proc.kill)  # a driver that ignored the signal would fail the test, not hang it
    guard.start()
    try:
        seen = []
        for line in proc.stdout:  # until run 2 waits
            seen.append(line)
            if line == "waiting for Ctrl-C\n":
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = "".join(seen) + proc.stdout.read(), proc.stderr.read()
        proc.wait()
    finally:
        guard.cancel()
    assert proc.returncode == 130, err
    assert "attempt: run 3 of 3" not in out
    assert "attempt: 1 of 3 runs done, 0 failed; mean final val loss 3.2701 over 1 finished; stopped: run 2 " \
           "interrupted\n" in out
    interrupted = os.path.join(records, "run_seed21.txt")
    assert parse_log(interrupted).status == "interrupted"  # the run wrote its last line before the verdict
    (verdict,) = [p for p in os.listdir(records) if p.endswith(".verdict")]
    text = open(os.path.join(records, verdict)).read()
    assert text.startswith("attempt verdict -- partial (1 of 3 runs): ") and text in out
    assert "note: a test of 1 of the 3 runs planned: stopping an attempt when its result looks good" in text
    assert "run 2 (seed 21): interrupted" in text and "failed" not in text
    assert re.search(r"skipped \S*run_seed21.txt: the run did not finish \(interrupted at step 20/40\)", text)
    assert "runs: 1 (1 JAX train_gpt.py log)" in text and "one run: no t-test" in text


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_bad_runs_values_are_refused_before_anything_runs(value, capsys):
    with pytest.raises(SystemExit) as e:
        attempt.main(["--runs", value, "--num-scheduled-iterations", "5"])
    assert e.value.code == 2
    assert f"--runs must be a whole number of runs, at least 1 (got '{value}'); for example --runs 3" in \
        capsys.readouterr().err


def test_the_driver_does_not_import_jax(tmp_path):
    probe = ("import sys; import records.attempt; "
             "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')]")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_against_logs_are_checked_before_any_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        attempt.main(["--runs", "2", "--against", str(tmp_path / "nothing_*.txt")])
    assert e.value.code == 2 and f"--against: no file matches {tmp_path / 'nothing_*.txt'}" in capsys.readouterr().err
    cut = write_log(tmp_path / "cut.txt", HP, [10.8, 5, 4], 100.0, end="interrupted")
    with pytest.raises(SystemExit) as e:  # an unfinished log: the fix is the attempt's, not stats.py's flag
        attempt.main(["--runs", "2", "--against", cut])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "did not finish" in err and "(name only finished runs' logs in --against)" in err
    assert "--skip-incomplete" not in err


def test_plot_is_checked_before_any_run(tmp_path, capsys, monkeypatch):
    """A missing optional extra, or a folder that cannot take the plot, would otherwise surface in the
    verdict, after the runs (where it used to replace the statistics)."""
    monkeypatch.setattr(attempt, "PLOT_EXTRAS", ("matplotlib", "no_such_module_here"))
    with pytest.raises(SystemExit) as e:
        attempt.main(["--runs", "2", "--plot", str(tmp_path / "a.png"), "--check"])
    assert e.value.code == 2
    assert "--plot needs no_such_module_here, optional extras not installed here: pip install no_such_module_here," \
        in capsys.readouterr().err
    monkeypatch.undo()
    with pytest.raises(SystemExit) as e:
        attempt.main(["--runs", "2", "--plot", str(tmp_path / "nowhere" / "a.png"), "--check"])
    assert e.value.code == 2 and f"{tmp_path / 'nowhere'} is no folder this user can write to" in capsys.readouterr().err
    assert attempt.main(["--runs", "2", "--plot", str(tmp_path / "a.png"), "--check"]) == 0  # extras here, folder too


def test_a_python_without_jax_is_refused_before_any_run(capsys, monkeypatch):
    """The verdict's command line and the README's say `python records/attempt.py`: outside the environment
    run.sh made there is no jax, and the script's check would end in a traceback."""
    real = attempt.importlib.util.find_spec
    monkeypatch.setattr(attempt.importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a))
    monkeypatch.setattr(attempt.subprocess, "run", lambda *a, **k: pytest.fail(f"started {a}"))  # no script check
    with pytest.raises(SystemExit) as e:
        attempt.main(["--runs", "2", "--check"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"this Python ({sys.executable}) has no jax" in err and "source .venv/bin/activate" in err


# ---- run.sh --runs

def repo_copy(tmp_path):
    """The repository's scripts without data, and an environment whose virtual env is active: what
    run.sh would download or generate shows up in the copy."""
    repo = tmp_path / "repo"
    for folder in ("data", "records"):
        (repo / folder).mkdir(parents=True)
        for source in os.listdir(os.path.join(ROOT, folder)):
            if source.endswith((".py", ".tiktoken", ".tsv")):
                shutil.copy2(os.path.join(ROOT, folder, source), repo / folder / source)
    for name in ["run.sh", "train_gpt.py", "requirements.txt"]:
        shutil.copy2(os.path.join(ROOT, name), repo / name)
    venv_bin = os.path.dirname(sys.executable)
    env = dict(os.environ, VIRTUAL_ENV=os.path.dirname(venv_bin), PATH=venv_bin + os.pathsep + os.environ["PATH"],
               HF_HUB_OFFLINE="1", PIP_NO_INDEX="1")  # the packages are here already: no network needed
    return repo, env


def test_run_sh_refuses_a_bad_runs_value_before_any_data_work(tmp_path):
    """run.sh asks the driver before its data step (the driver's check of 0, -1 and x is tested above)."""
    repo, env = repo_copy(tmp_path)
    r = subprocess.run([str(repo / "run.sh"), "--runs", "-1", "--num-scheduled-iterations", "5"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--runs must be a whole number of runs, at least 1 (got '-1')" in r.stderr
    assert not (repo / "data" / "fineweb10B").exists() and not (repo / "data" / "synthetic").exists()
    assert list(repo.rglob("*.bin")) == [] and list((repo / "records").glob("*.txt")) == []


def test_run_sh_checks_the_scripts_options_before_any_data_work(tmp_path):
    """A bad train_gpt.py option (train_gpt.py --check, for one run or through the attempt), or --script
    without its path, exits 2 before run.sh downloads or generates anything."""
    repo, env = repo_copy(tmp_path)
    for argv, says in ((["--num-scheduled-iterations", "-1"], "--num-scheduled-iterations -1 must be at least 3"),
                       (["--runs", "2", "--num-scheduled-iterations", "-1"], "--num-scheduled-iterations -1 must be"),
                       (["--num-scheduled-iterations", "5", "--script"], "run.sh: --script needs a path")):
        r = subprocess.run([str(repo / "run.sh"), *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and says in r.stderr, (argv, r.stderr)
        assert "SYNTHETIC" not in r.stdout and not (repo / "data" / "synthetic").exists()
        assert not (repo / "data" / "fineweb10B").exists() and list(repo.rglob("*.bin")) == []
    r = subprocess.run([str(repo / "run.sh"), "--runs", "2", "--help"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "usage: records/attempt.py" in r.stdout  # the attempt's options, not the script's
    r = subprocess.run([str(repo / "run.sh"), "--check", "--num-scheduled-iterations", "30"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and not (repo / "data" / "synthetic").exists()  # that only
    assert r.stdout == "run.sh --check: no problem found in the options (shards and weight files are read when a " \
                       "run starts)\n"
    (tmp_path / "plain.py").write_text("print('trained')\n")  # a script without --check: not said to be checked
    r = subprocess.run([str(repo / "run.sh"), "--check", "--script", str(tmp_path / "plain.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    assert r.stdout == f"{tmp_path / 'plain.py'} has no --check: its options are checked when it runs\n"
    r = subprocess.run([sys.executable, ATTEMPT, "--runs", "2", "--num-scheduled-iterations", "-1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)  # the driver alone asks too, before run 1
    assert r.returncode == 2 and "--num-scheduled-iterations -1 must be" in r.stderr and "run 1" not in r.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="with GPUs run.sh downloads 8 FineWeb shards")
def test_run_sh_leaves_the_data_to_whoever_names_it(tmp_path, fake):
    """Both data flags: no data work. One: FineWeb's shards for the other half (the user's flag after run.sh's
    data flags: it wins); where FineWeb cannot be had, exit 2, not synthetic shards mixed with the user's."""
    repo, env = repo_copy(tmp_path)
    script, templates, records = fake(finished={5: 3.27})
    r = subprocess.run([str(repo / "run.sh"), "--script", script, "--train-files", "mine/train_*.bin", "--val-files",
                        "mine/val_*.bin", "--templates", templates, "--records-dir", records, "--seed", "5"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--train-files/--val-files given: no data downloaded or generated" in r.stdout
    assert "argv: ['--train-files', 'mine/train_*.bin', '--val-files', 'mine/val_*.bin'," in r.stdout
    assert "SYNTHETIC" not in r.stdout and not (repo / "data" / "synthetic").exists()
    assert not (repo / "data" / "fineweb10B").exists()
    (repo / "data" / "synthetic").mkdir()
    (repo / "data" / "synthetic" / "synthetic_val_000000.bin").touch()  # a complete synthetic set, not to be used

    def alone(*flag):
        return subprocess.run([str(repo / "run.sh"), "--script", script, *flag, "--templates", templates,
                               "--records-dir", records, "--seed", "5"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)

    r = alone("--val-files", "mine/val_*.bin")  # offline (HF_HUB_OFFLINE), no FineWeb train shard here
    assert r.returncode == 2 and "argv:" not in r.stdout and "SYNTHETIC" not in r.stdout
    assert "FineWeb could not be downloaded for the half that --val-files leaves open" in r.stderr, r.stderr
    assert "give both --train-files and --val-files, or neither" in r.stderr
    (repo / "data" / "fineweb10B").mkdir(exist_ok=True)  # (the failed download made it)
    write_shard(str(repo / "data" / "fineweb10B" / "fineweb_val_000000.bin"), np.zeros(1000, np.uint16))
    r = alone("--train-files", "mine/train_*.bin")  # FineWeb's val shard present: its download skipped, no network
    assert r.returncode == 0, r.stderr
    assert "--train-files given alone: FineWeb's shards for the other half (data/cached_fineweb10B.py 0," in r.stdout
    assert "argv: ['--train-files', 'mine/train_*.bin', '--templates'," in r.stdout and "SYNTHETIC" not in r.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="with GPUs run.sh downloads 8 FineWeb shards")
def test_run_sh_hands_runs_to_the_driver_with_its_data_flags(tmp_path, fake):
    repo, env = repo_copy(tmp_path)
    (repo / "data" / "synthetic").mkdir()
    (repo / "data" / "synthetic" / "synthetic_val_000000.bin").touch()  # a complete set: nothing generated
    script, templates, records = fake(finished={3: 3.27, 4: 3.26})
    r = subprocess.run([str(repo / "run.sh"), "--runs", "2", "--seed", "3", "--script", script, "--templates",
                        templates, "--records-dir", records], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "SYNTHETIC shards (data/synthetic/)" in r.stdout and "this run goes on" in r.stdout
    assert (f"argv: ['--train-files', 'data/synthetic/synthetic_train_*.bin', '--val-files', "
            f"'data/synthetic/synthetic_val_*.bin', '--templates', '{templates}', '--records-dir', '{records}', "
            f"'--seed', '4']") in r.stdout
    assert "attempt verdict: python records/attempt.py --train-files" in r.stdout and "runs: 2 (2 JAX" in r.stdout


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="with GPUs run.sh downloads 8 FineWeb shards")
def test_run_sh_script_runs_another_script_once_with_the_data_flags(tmp_path, fake):
    """./run.sh --script PATH (no --runs): PATH once, with run.sh's data flags and the other options;
    a missing script exits 2 before any data work."""
    repo, env = repo_copy(tmp_path)
    (repo / "data" / "synthetic").mkdir()
    (repo / "data" / "synthetic" / "synthetic_val_000000.bin").touch()  # a complete set: nothing generated
    script, templates, records = fake(finished={5: 3.27})
    r = subprocess.run([str(repo / "run.sh"), "--script", script, "--templates", templates, "--records-dir", records,
                        "--seed", "5"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (f"argv: ['--train-files', 'data/synthetic/synthetic_train_*.bin', '--val-files', "
            f"'data/synthetic/synthetic_val_*.bin', '--templates', '{templates}', '--records-dir', '{records}', "
            f"'--seed', '5']") in r.stdout
    assert "attempt" not in r.stdout and len(list((tmp_path / "records").glob("*.txt"))) == 1
    assert f"{script} has no --check: its options are checked when it runs" in r.stdout  # (the fake has none)
    r = subprocess.run([str(repo / "run.sh"), "--script", str(tmp_path / "nothing.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--script {tmp_path / 'nothing.py'}: no such file" in r.stderr


# ---- what the verdict adds to stats.py

def test_runs_needed_for_record_20_and_its_meaning():
    """Record 20: 32 runs, mean 3.2787, std 0.0018. At that mean and std the record test (one-sided,
    p < 0.01) passes with 80% probability from 23 runs on: checked here by simulating attempts."""
    n = stats.runs_needed(3.2787, 0.0018, 3.28, 0.01)
    assert n == 23
    rng = np.random.default_rng(0)

    def passes(runs):  # the fraction of 20,000 simulated attempts of `runs` runs whose record test passes
        losses = rng.normal(3.2787, 0.0018, (20_000, runs))
        return (scipy_stats.ttest_1samp(losses, 3.28, axis=1, alternative="less").pvalue < 0.01).mean()

    assert passes(n) > 0.8 - 0.01 and passes(n - 2) < 0.8 - 0.01  # 0.82 and 0.775 by the formula
    assert stats.runs_needed(3.2799, 0.0018, 3.28, 0.01) == pytest.approx(3260, rel=0.01)
    assert stats.runs_needed(3.27999, 0.0018, 3.28, 0.01) is None  # beyond 10,000 runs


def test_stats_prints_the_spread_beside_record_20_and_the_runs_needed(tmp_path, capsys):
    losses = [3.2772, 3.2801, 3.2790, 3.2785, 3.2779]
    logs = [write_log(tmp_path / f"{i}.txt", dataclasses.replace(HP, seed=i), [10.8, 5, 4, 3.5, x], 100.0)
            for i, x in enumerate(losses)]
    assert stats.main(logs) == 0
    out = capsys.readouterr().out
    mean, std = statistics.mean(losses), statistics.stdev(losses)
    n = stats.runs_needed(mean, std, 3.28, 0.01)
    assert f"spread: std {std:.4f}; record 89's: 0.0014 over its 13 runs\n" in out
    assert (f"runs needed: {n} for the record test to pass at p<0.01 with 80% probability, if the runs' true mean "
            f"and std are {mean:.4f} and {std:.4f}") in out


def edit(path, old, new):
    with open(path) as f:
        text = f.read()
    assert old in text
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def group(tmp_path, name, losses, seeds=None, step_ms=100.0, devices=None):
    """Our logs, one per loss, with the given seeds, step times step_ms + i and Devices line."""
    logs = []
    for i, loss in enumerate(losses):
        path = write_log(tmp_path / f"{name}{i}.txt", dataclasses.replace(HP, seed=(seeds or range(100))[i]),
                         [10.8, 5, 4, 3.5, loss], step_ms + i)
        if devices:
            edit(path, "Devices: 1 x cpu (cpu)", f"Devices: {devices}")
        logs.append(path)
    return logs


def test_the_paired_test_by_seed_matches_scipy(tmp_path, capsys):
    a = [3.2770, 3.2790, 3.2781, 3.2779, 3.2800]  # seeds 1-5
    b = [round(x + d, 4) for x, d in zip(a, [0.0011, 0.0009, 0.0012, 0.0010, 0.0011])]  # the same seeds, a bit worse
    ours = group(tmp_path, "a", a, seeds=[1, 2, 3, 4, 5])
    (tmp_path / "b").mkdir()  # written in another seed order, and seed 9 has no partner
    group(tmp_path / "b", "b", b[::-1] + [3.2700], seeds=[5, 4, 3, 2, 1, 9])
    assert stats.main(ours + ["--against", str(tmp_path / "b")]) == 0  # a folder stands for its logs
    out = capsys.readouterr().out
    paired = scipy_stats.ttest_rel(a, b, alternative="less")
    mean = statistics.mean(x - y for x, y in zip(a, b))
    assert (f"paired t-test by seed (5 shared seeds), H1: final val loss of the runs < that of the --against runs at "
            f"the same seed: mean difference {mean:+.4f}, t = {paired.statistic:.3f}, df = 4, "
            f"p = {paired.pvalue:.3g}") in out
    welch = scipy_stats.ttest_ind(a, b + [3.2700], equal_var=False, alternative="less")
    assert f"p = {welch.pvalue:.3g}" in out and paired.pvalue < 0.01 < welch.pvalue  # pairing sees what Welch cannot
    assert "the runs' final val loss is below the --against runs' at the same seed at p<0.01" in out
    assert stats.main(ours + ["--against", *group(tmp_path, "c", b[:2], seeds=[1, 7])]) == 0
    assert "no paired test by seed: 1 seed(s) shared by both groups; it needs at least 2" in capsys.readouterr().out
    assert stats.main(ours + ["--against", write_torch_log(tmp_path / "t.txt", [10.8, 5, 4, 3.5, 3.28]),
                              write_torch_log(tmp_path / "u.txt", [10.8, 5, 4, 3.5, 3.29])]) == 0
    assert re.search(r"no paired test by seed: \S+t.txt \(the --against runs\) names no seed", capsys.readouterr().out)


def time_test_lines(a: list, b: list, clock: str) -> str:
    """What stats.py prints for Welch's test of the training times (seconds) a < b on `clock`, up to t."""
    welch = scipy_stats.ttest_ind(a, b, equal_var=False, alternative="less")
    return (f"training time on {clock}: runs mean {statistics.mean(a):.2f}s, --against runs mean "
            f"{statistics.mean(b):.2f}s\nWelch's t-test, H1: mean training time of the runs < that of the --against "
            f"runs: t = {welch.statistic:.3f}")


def test_the_time_test_between_our_runs_on_the_same_devices(tmp_path, capsys):
    fast = group(tmp_path, "f", [3.27, 3.28, 3.29], step_ms=90.0, devices="8 x NVIDIA H100 80GB HBM3 (gpu)")
    slow = group(tmp_path, "s", [3.27, 3.28, 3.29], step_ms=100.0, devices="8 x NVIDIA H100 80GB HBM3 (gpu)")
    assert stats.main(fast + ["--against"] + slow) == 0
    out = capsys.readouterr().out
    a, b = [40 * (90 + i) / 1000 for i in range(3)], [40 * (100 + i) / 1000 for i in range(3)]
    p = scipy_stats.ttest_ind(a, b, equal_var=False, alternative="less").pvalue
    assert (time_test_lines(a, b, "the JAX clock (every step)") + f", df = 4.0, p = {p:.3g}\n"
            f"the runs' mean training time is below the --against runs' at p<0.01") in out


def on_8_h100s(path):
    """A PyTorch log's nvidia-smi table made to list 8 GPUs (the writer's lists one)."""
    one = "|   0  NVIDIA H100 80GB HBM3   On  |   7746MiB /  81559MiB  |\n"
    assert one in NVIDIA_SMI
    edit(path, NVIDIA_SMI, NVIDIA_SMI.replace(one, "".join(one.replace("|   0", f"|   {i}") for i in range(8))))
    return path


def test_the_time_test_puts_our_runs_on_the_pytorch_clock(tmp_path, capsys):
    ours = group(tmp_path, "o", [3.27, 3.28, 3.29], step_ms=100.0, devices="8 x NVIDIA H100 80GB HBM3 (gpu)")
    theirs = [on_8_h100s(write_torch_log(tmp_path / f"t{i}.txt", [10.8, 5, 4, 3.5, loss], step_ms=110.0 + i))
              for i, loss in enumerate([3.28, 3.281, 3.279])]
    assert parse_log(theirs[0]).devices == (8, "NVIDIA H100 80GB HBM3")
    assert stats.main(ours + ["--against"] + theirs) == 0
    out = capsys.readouterr().out
    a = [30 * (100 + i) / 1000 for i in range(3)]  # 40 steps, the first 10 left out
    b = [30 * (110 + i) / 1000 for i in range(3)]
    assert time_test_lines(a, b, "the PyTorch clock (without the first 10 steps; JAX runs: time at the end minus at "
                                 "step 10)") in out


def test_the_time_test_against_pytorch_logs_that_time_every_step(tmp_path, capsys):
    """From record 22 on (record 89's logs) the PyTorch script compiles in a warm-up and its clock covers
    every step, as ours: the times compare as they are; with records 18-21's logs mixed in, they do not."""
    ours = group(tmp_path, "o", [3.27, 3.28, 3.29], step_ms=100.0, devices="8 x NVIDIA H100 80GB HBM3 (gpu)")
    theirs = [on_8_h100s(write_torch_log(tmp_path / f"t{i}.txt", [10.8, 5, 4, 3.5, loss], step_ms=110.0 + i,
                                         clock_restart=None)) for i, loss in enumerate([3.28, 3.281, 3.279])]
    assert parse_log(theirs[0]).untimed_steps == 0 and parse_log(theirs[0]).timed_steps == 40
    assert stats.main(ours + ["--against"] + theirs) == 0
    out = capsys.readouterr().out
    a, b = [40 * (100 + i) / 1000 for i in range(3)], [40 * (110 + i) / 1000 for i in range(3)]
    assert time_test_lines(a, b, "the clock of every step (the PyTorch logs' starts after their warm-up compiled)") \
        in out
    assert stats.main(theirs[:2] + ["--against", theirs[2]]) == 0  # PyTorch against PyTorch too
    assert "training time on the clock of every step" in capsys.readouterr().out
    old = on_8_h100s(write_torch_log(tmp_path / "old.txt", [10.8, 5, 4, 3.5, 3.283]))  # restarts after step 10
    assert stats.main(ours + ["--against", theirs[0], old]) == 0
    assert ("times not comparable: the PyTorch logs' clocks leave out different numbers of first steps ([0, 10]: "
            "records 18-21 restart theirs after step 10, later ones compile before it starts); no time test") \
        in capsys.readouterr().out
    assert compare.main([ours[0], theirs[0]]) == 0
    assert ("clock of B (PyTorch): excludes validation; covers every step, compilation happens in a warm-up "
            "before it") in capsys.readouterr().out


def test_the_time_test_refuses_other_devices_and_other_clocks(tmp_path, capsys):
    cpu = group(tmp_path, "c", [3.27, 3.28])
    gpu = group(tmp_path, "g", [3.27, 3.28], devices="1 x NVIDIA H100 80GB HBM3 (gpu)")
    torch = [write_torch_log(tmp_path / f"t{i}.txt", [10.8, 5, 4, 3.5, x]) for i, x in enumerate([3.28, 3.29])]
    assert stats.main(cpu + ["--against"] + torch) == 0
    out = capsys.readouterr().out
    assert (f"times not comparable: the runs ran on different devices: 1 x cpu ({cpu[0]}), 1 x NVIDIA H100 80GB HBM3 "
            f"({torch[0]}); no time test") in out and "training time on" not in out
    assert stats.main(cpu + ["--against"] + gpu) == 0
    assert "times not comparable: the runs ran on different devices: 1 x cpu" in capsys.readouterr().out
    short = [write_log(tmp_path / f"short{i}.txt", hp_with(8, val_loss_every=4, seed=i),
                       [10.8, 4, x], 100.0) for i, x in enumerate([3.27, 3.28])]
    for path in short:  # on the H100 of the PyTorch logs, but 8 steps: no step line 10 for their clock
        edit(path, "Devices: 1 x cpu (cpu)", "Devices: 1 x NVIDIA H100 80GB HBM3 (gpu)")
    assert stats.main(short + ["--against"] + torch) == 0
    assert (f"times not comparable: {short[0]} has no step line 10, so its time cannot be put on the PyTorch clock; "
            f"no time test") in capsys.readouterr().out


# ---- pictures

def record_like(tmp_path):
    """Our log and a PyTorch log whose curves end near 3.28, as a record's do."""
    a = write_log(tmp_path / "a.txt", HP, [10.83, 4.41, 3.61, 3.36, 3.2779], 100.0)
    b = write_torch_log(tmp_path / "b.txt", [10.83, 4.40, 3.60, 3.35, 3.2803])
    return a, b


def test_compare_plot_has_a_decisive_panel_around_the_target(tmp_path):
    a, b = record_like(tmp_path)
    baseline = compare.load_baseline("record20")
    fig = compare.plot(parse_log(a), parse_log(b), str(tmp_path / "cmp.png"), baseline, "record20")
    *whole, decisive = fig.axes
    bottom, top = decisive.get_ylim()
    assert top - bottom <= 0.5
    assert bottom < 3.2779 and 3.2803 < top and bottom < 3.28 < top and bottom < 3.2785 < top  # baseline's too
    (target,) = [line for line in decisive.lines if line.get_label() == "target 3.28"]
    assert list(target.get_ydata()) == [3.28, 3.28]
    assert [line.get_label() for line in decisive.lines[:2]] == ["A: a.txt (JAX, preset cpu): last 3.2779",
                                                                  "B: b.txt (PyTorch): last 3.2803"]
    assert list(decisive.lines[0].get_ydata()) == [10.83, 4.41, 3.61, 3.36, 3.2779]
    left, right = decisive.get_xlim()  # from the last point above the panel (the baseline's, at step 625) on
    assert left == pytest.approx(625 / 1393) and right >= 1.0
    for ax in whole:  # the whole curves, from ln(50304), stay above
        assert ax.get_ylim()[1] > 10.8 and ax.get_ylim()[0] < 3.28


def test_the_decisive_range_grows_only_when_the_losses_lie_far_apart():
    assert compare.decisive_range([3.2779, 3.2803], 3.28) == pytest.approx((3.2779 - 0.1 * (0.3 - 0.0024),
                                                                             3.2779 - 0.1 * (0.3 - 0.0024) + 0.3))
    bottom, top = compare.decisive_range([1.34, 1.40], 3.28)  # a CPU run on synthetic shards
    assert bottom < 1.34 and top > 3.28 and top - bottom == pytest.approx(1.25 * (3.28 - 1.34))


def test_stats_plot_shows_each_run_the_target_and_the_means_with_intervals(tmp_path):
    a_losses, b_losses = [3.2772, 3.2801, 3.2790], [3.2795, 3.2810, 3.2788, 3.2805]
    runs = [parse_log(p) for p in group(tmp_path, "a", a_losses)]
    against = [parse_log(p) for p in group(tmp_path, "b", b_losses, step_ms=120.0)]
    fig = stats.plot([("runs", runs), ("--against", against)], str(tmp_path / "s.png"), 3.28, 0.01)
    loss_ax, time_ax = fig.axes
    lines = {line.get_label(): line for line in loss_ax.lines}
    assert list(lines["runs: 3 run(s)"].get_ydata()) == a_losses
    assert list(lines["--against: 4 run(s)"].get_ydata()) == b_losses
    assert list(lines["target 3.28"].get_ydata()) == [3.28, 3.28]
    for label, losses in (("runs", a_losses), ("--against", b_losses)):
        n, mean = len(losses), np.mean(losses)
        half = scipy_stats.t.ppf(0.99, n - 1) * np.std(losses, ddof=1) / np.sqrt(n)
        assert list(lines[f"{label}: mean"].get_ydata()) == pytest.approx([mean])
        assert list(lines[f"{label}: 98% CI"].get_ydata()) == pytest.approx([mean - half, mean + half])
    bottom, top = loss_ax.get_ylim()
    assert bottom < min(a_losses + b_losses) and max(a_losses + b_losses + [3.28]) < top and top - bottom < 0.05
    times = {line.get_label(): line for line in time_ax.lines}
    assert list(times["runs: 3 run(s)"].get_ydata()) == pytest.approx([4.0, 4.04, 4.08])
    assert "the JAX clock" in time_ax.get_title()


def test_a_console_that_is_gone_does_not_stop_the_attempt(tmp_path, monkeypatch):
    """`./run.sh --runs N | tee` and Ctrl-C: tee dies first, and the attempt's next line meets a broken pipe. The
    run's output is still read to its end (its log found, the run waited for) and the attempt's own lines go
    nowhere, where a BrokenPipeError had ended the attempt without its verdict."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone
    console = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdout", console)
    run, log = attempt.Run(1, 0), tmp_path / "run.txt"
    child = f"print('step 1'); print('record log: {log}'); print('step 2')"
    attempt.run_once(run, [sys.executable, "-c", child], {"signal": None, "child": None})
    attempt.say("attempt: the tally")
    monkeypatch.undo()
    console.close()
    assert run.code == 0 and run.log == str(log)
