"""§1 Hyperparameters: every flag is checked at construction (one case per rule), bad flags exit 2
before any work, train_gpt.py stands alone (runs from a copy, importing it changes nothing), and
the schedule is the reference's, step by step (tests/ref89_schedule.tsv, written by its own code)."""
import csv
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

import train_gpt as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD = [  # (overrides, the flag the message must name)
    ({"head_dim": 12}, "--head-dim"),
    ({"head_dim": 8}, "--head-dim"),
    ({"num_scheduled_iterations": 2}, "--num-scheduled-iterations"),
    ({"num_extension_iterations": -1}, "--num-extension-iterations"),
    ({"cooldown_frac": 0.0}, "--cooldown-frac"),
    ({"cooldown_frac": 1.5}, "--cooldown-frac"),
    ({"attention": "flash"}, "--attention"),
    ({"bos_id": 50257}, "--bos-id"),
    ({"bos_id": -1}, "--bos-id"),
    ({"val_tokens": 3000}, "--val-tokens"),
    ({"val_batch_size": 1000}, "--val-batch-size"),
    ({"vocab_size": 0}, "--vocab-size"),
    ({"val_loss_every": -1}, "--val-loss-every"),
    ({"muon_lr": -1.0}, "--muon-lr"),
    ({"adam_lr": float("nan")}, "--adam-lr"),
    ({"muon_momentum_warmup_steps": -1}, "--muon-momentum-warmup-steps"),
    ({"fp8_bootstrap_steps": -1}, "--fp8-bootstrap-steps"),
    ({"train_files": ""}, "--train-files"),
]


@pytest.mark.parametrize("overrides, flag", BAD, ids=[",".join(o) + "=" + str(list(o.values())) for o, _ in BAD])
def test_each_rule_rejects_with_the_flag_named(overrides, flag):
    with pytest.raises(tg.ConfigError, match=flag):
        dataclasses.replace(tg.PRESETS["cpu"], **overrides)


def test_presets_pass_their_own_rules():
    for hp in tg.PRESETS.values():
        dataclasses.replace(hp)  # re-runs __post_init__


@pytest.mark.parametrize("argv, expect", [
    (["--num-scheduled-iterations", "0"], "error: bad hyperparameters"),
    (["--head-dim", "12"], "error: bad hyperparameters"),
    (["--val-loss-every", "-1"], "error: bad hyperparameters"),
    (["--stage-batch-sizes", "1024,1024"], "--stage-batch-sizes '1024,1024': give 4 comma-separated integers"),
    (["--stage-batch-sizes", "1000,1024,1024,1024"], "stage 0: batch 1000 must split into 8 ranks"),
    # 8 chunks of 144 tokens: not whole 128-token attention blocks (XLA failed to reshape them at compile time)
    (["--stage-batch-sizes", "1024,1152,1024,1024"], "stage 1: batch 1152 must split into 8 ranks of a multiple of 128"),
    (["--val-batch-size", "1152", "--val-tokens", "1152"], "a positive multiple of 1024"),
    (["--cooldown-frac", "1e-17"], "--cooldown-frac 1e-17 must be in (0, 1] and cover at least one"),
    (["--seed", str(2**32)], "--seed 4294967296 must be in [0, 2**32)"),
    (["--stage-max-seq-lens", "128,x,128,128"], "--stage-max-seq-lens '128,x,128,128': give 4"),
    (["--stage-mtp-terms", "3,2,1"], "--stage-mtp-terms '3,2,1': give 4 comma-separated integers"),
    (["--stage-mtp-terms", "3,3,1,0"], "a stage keeps 1 up to its number of MTP weights (stage 1 has 2, stage 3 has 1)"),
])
def test_bad_flags_exit_2_before_any_work(argv, expect, tmp_path, capsys):
    assert tg.main([*argv, "--records-dir", str(tmp_path / "records")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expect in err and "Traceback" not in err, err
    assert not (tmp_path / "records").exists()


def test_check_answers_for_the_options_alone(tmp_path, capsys):
    """--check (run.sh asks it before its data work): the same verdict on the options, and nothing else."""
    records = str(tmp_path / "records")
    assert tg.main(["--check", "--num-scheduled-iterations", "0", "--records-dir", records]) == 2
    assert "error: bad hyperparameters" in capsys.readouterr().err
    missing = str(tmp_path / "none_*.bin")  # shards are the run's to check, not --check's
    assert tg.main(["--check", "--train-files", missing, "--records-dir", records]) == 0
    assert capsys.readouterr() == ("", "") and not (tmp_path / "records").exists()
    with pytest.raises(SystemExit) as e:  # whole flags only: run.sh and attempt.py look for them so
        tg.main(["--check", "--train-file", missing])
    err = capsys.readouterr().err  # with the nearest flag, under a one-line usage
    assert e.value.code == 2 and f"unrecognized arguments: --train-file {missing} (did you mean --train-files for " \
                                 "--train-file?)" in err
    assert err.splitlines()[0].endswith(" [options]  (--help lists them)") and len(err.splitlines()) == 2


@pytest.mark.parametrize("flag, on_gpu", [("attention", "pallas"), ("dc", "xla"), ("mlp", "pallas"), ("head", "xla")])
def test_auto_picks_by_backend_and_says_so(monkeypatch, capsys, tmp_path, flag, on_gpu):
    """auto: AUTO_ON_GPU's on GPUs (the head's and the DC correction's Pallas kernels wait for a GPU run),
    xla elsewhere."""
    seen = []
    monkeypatch.setattr(tg, "train", lambda hp, *rest: seen.append(hp))
    argv = ["--preset", "cpu", "--compile-cache-dir", "", "--records-dir", str(tmp_path)]
    option, other = f"--{flag}", {"xla": "pallas", "pallas": "xla"}[on_gpu]
    for backend, flags, expect in [("cpu", [], "xla"), ("gpu", [], on_gpu), ("gpu", [option, "auto"], on_gpu),
                                   ("gpu", [option, other], other), ("cpu", [option, "pallas"], "pallas")]:
        monkeypatch.setattr(tg.jax, "default_backend", lambda: backend)
        assert tg.main([*argv, *flags]) == 0
        assert getattr(seen[-1], flag) == expect, (backend, flags)
        said = f"{flag} {expect} (chosen because the JAX backend is {backend}; pass {option} to choose)"
        assert (said in capsys.readouterr().out) == (flags in ([], [option, "auto"])), (backend, flags)
        others = [name for name in tg.AUTO_FIELDS if name != flag]  # each flag on its own: the others stay auto
        assert all(getattr(seen[-1], name) == (tg.AUTO_ON_GPU[name] if backend == "gpu" else "xla") for name in others)
    assert tg.parse_args([option, "auto"])[1] == {} and tg.parse_args([option, "xla"])[1] == {flag: "xla"}
    assert tg.parse_args(["--records-dir", "auto"])[1] == {"records_dir": "auto"}  # only these flags' auto is main's


def test_stage_flags_change_only_their_field():
    args, overrides = tg.parse_args(["--stage-batch-sizes", "1024,2048,3072,3072", "--stage-max-seq-lens",
                                     "128,256,256,512", "--stage-mtp-terms", "2,1,1,1"])
    hp = tg.with_stage_flags(dataclasses.replace(tg.PRESETS["cpu"], **overrides), args)
    assert [s.batch_size for s in hp.stages] == [1024, 2048, 3072, 3072]
    assert [s.max_seq_len for s in hp.stages] == [128, 256, 256, 512]
    # the first N weights of each stage, start and end alike: stage 0 (1, .5, .25) -> (1, .5, 0) keeps two
    assert [(s.mtp_start, s.mtp_end) for s in hp.stages] == [((1.0, 0.5), (1.0, 0.5)), ((1.0,), (1.0,)),
                                                              ((1.0,), (1.0,)), ((1.0,), (1.0,))]
    assert [tg.loss_weights(step, hp)[0].shape for step in (0, hp.total_steps - 1)] == [(2,), (1,)]
    for new, old in zip(hp.stages, tg.PRESETS["cpu"].stages):
        assert dataclasses.replace(new, batch_size=old.batch_size, max_seq_len=old.max_seq_len,
                                   mtp_start=old.mtp_start, mtp_end=old.mtp_end) == old


def test_a_copy_of_the_script_runs_alone_and_import_has_no_side_effects(tmp_path):
    copy = tmp_path / "attempt" / "train_gpt.py"
    copy.parent.mkdir()
    copy.write_text(open(os.path.join(ROOT, "train_gpt.py")).read())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONFAULTHANDLER")}
    result = subprocess.run([sys.executable, str(copy), "--help"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=300)
    assert result.returncode == 0 and "--init-weights" in result.stdout, result.stderr[-2000:]
    # run as a script, it has faulthandler print every thread's stack at a crash in native code (a
    # segmentation fault); imported or called (main), it leaves faulthandler as it is (pytest's)
    check = ("import faulthandler, runpy, sys; before = list(sys.path); import train_gpt; "
             "assert sys.path == before, 'sys.path changed'; assert train_gpt.SOURCE == open(train_gpt.__file__).read(); "
             "assert train_gpt.main(['--check', '--records-dir', 'r']) == 0; assert not faulthandler.is_enabled(); "
             "sys.argv = ['train_gpt.py', '--check', '--records-dir', 'r']\n"
             "try: runpy.run_path(train_gpt.__file__, run_name='__main__')\n"
             "except SystemExit as e: assert e.code == 0, e.code\n"
             "assert faulthandler.is_enabled(), 'a segmentation fault would print no stack'")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=copy.parent, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_gpt2_vocabulary_is_found_next_to_the_script_or_in_the_current_folder(tmp_path, monkeypatch):
    assert tg.gpt2_vocab() == os.path.join(ROOT, "data", "gpt2.tiktoken")  # next to the script
    monkeypatch.setattr(tg, "__file__", str(tmp_path / "copy.py"))
    monkeypatch.chdir(ROOT)
    assert tg.gpt2_vocab() == os.path.join(ROOT, "data", "gpt2.tiktoken")  # a copy elsewhere, run from the repository
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tg.DataError, match="data/gpt2.tiktoken"):
        tg.gpt2_vocab()


def test_help_says_what_each_hyperparameter_is(capsys):
    """Each Hyperparameters field's comment (`name: type = default  # note`) is its flag's --help, so every
    field needs one; the presets' defaults follow it."""
    notes = tg.field_notes()
    assert [f.name for f in tg.FLAG_FIELDS if f.name not in notes] == []
    with pytest.raises(SystemExit):
        tg.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert f"--val-loss-every VAL_LOSS_EVERY {notes['val_loss_every']} (record: 250, cpu: 8)" in text
    assert f"--compile-cache-dir COMPILE_CACHE_DIR {notes['compile_cache_dir']} (record:" in text


def reference_schedule():
    """tests/ref89_schedule.tsv's rows: {preset: [step row]}, {(preset, k): rotary frequencies}."""
    with open(os.path.join(ROOT, "tests", "ref89_schedule.tsv")) as f:
        rows = list(csv.DictReader((line for line in f if not line.startswith("#")), delimiter="\t"))
    steps, freqs = {}, {}
    for r in rows:
        if r["kind"] == "step":
            steps.setdefault(r["preset"], []).append(r)
        else:  # a freq row: its number in `step`, the values in `batch`
            freqs[r["preset"], int(r["step"])] = np.array(r["batch"].split(","), np.float32)
    return steps, freqs


@pytest.mark.parametrize("preset", ["record", "cpu"])
def test_the_schedule_is_the_references_at_each_step(preset):
    """Windows, batch and document length, lr and momentum multipliers, Adam's steps, the split, MTP
    and prefix weights, YaRN's frequencies and scale: what the reference's main loop uses at each of
    its steps (its TrainingSchedule, get_muon_momentum, advance_schedule and Yarn, run by
    tests/ref89_schedule.py), equal to train_gpt.py's: floats bit for bit. A changed cpu preset needs
    the table written again (the script's CPU constants changed with it)."""
    hp = tg.PRESETS[preset]
    steps, freqs = reference_schedule()
    rows = steps[preset]
    assert int(rows[-1]["step"]) == hp.total_steps and rows[-1]["last"] == "1"
    assert [int(r["step"]) for r in rows] == list(range(hp.total_steps + 1))
    split = [int(r["step"]) for r in rows if r["split"] == "1"]
    assert split == [tg.split_step(hp)]
    for r in rows:
        step, last = int(r["step"]), r["last"] == "1"
        stage = hp.stages[tg.stage_of(step, hp)[0]]
        got = dict(batch=stage.batch_size, max_seq_len=stage.max_seq_len, windows=tg.windows(step, hp, last),
                   lr=tg.lr_mul(step, hp), momentum=tg.muon_momentum(step, hp))
        want = dict(batch=int(r["batch"]), max_seq_len=int(r["max_seq_len"]),
                    windows=(int(r["ws_short"]), int(r["ws_long"])), lr=float(r["lr"]), momentum=float(r["momentum"]))
        assert got == want, step
        sv = tg.step_values_at(step, hp)
        assert (bool(sv["do_adam"]), bool(sv["split"]), bool(sv["tied"])) == (
            r["adam"] == "1", r["split"] == "1", step <= split[0]), step  # tied up to the split's update
        assert sv["momentum"] == np.float32(want["momentum"]), step
        mtp, prefix = tg.loss_weights(step, hp)
        assert mtp.dtype == np.float32 and mtp.tolist() == [float(w) for w in r["mtp"].split(",")], step
        assert prefix.dtype == np.float32 and float(prefix) == float(r["prefix"]), step
        freq, scale = tg.yarn_state(step, hp)
        assert np.array_equal(freq, freqs[preset, int(r["freq"])]) and scale == float(r["attn_scale"]), step
        a = tg.schedule_values(step, hp, last)  # what the forward gets: the same values
        assert (int(a["window_short"]), int(a["window_long"])) == want["windows"], step
        assert np.array_equal(np.asarray(a["freq"]), freq) and np.float32(a["scale"]) == np.float32(scale), step
