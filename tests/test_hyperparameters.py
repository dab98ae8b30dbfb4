"""§1 Hyperparameters: every flag is checked at construction (one case per rule), bad flags exit 2
before any work, and train_gpt.py stands alone (runs from a copy, importing it changes nothing)."""
import dataclasses
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

import train_gpt as tg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD = [  # (overrides, the flag the message must name)
    ({"num_iterations": 0}, "--num-iterations"),
    ({"num_iterations": -5}, "--num-iterations"),
    ({"num_heads": 0, "model_dim": 0}, "--model-dim"),
    ({"model_dim": 700}, "--model-dim"),
    ({"vocab_size": 0}, "--vocab-size"),
    ({"vocab_size": -3}, "--vocab-size"),
    ({"seq_len": 0}, "--seq-len"),
    ({"seq_len": -512}, "--seq-len"),
    ({"seq_len": 1000}, "--seq-len"),
    ({"batch_size": 0}, "--batch-size"),
    ({"batch_size": -2048}, "--batch-size"),
    ({"batch_size": 3 * 512 + 128}, "--batch-size"),
    ({"val_tokens": 0}, "--val-tokens"),
    ({"val_tokens": 3000}, "--val-tokens"),
    ({"num_layers": 5}, "--num-layers"),
    ({"num_layers": 4}, "--num-layers"),
    ({"cooldown_frac": 0.0}, "--cooldown-frac"),
    ({"cooldown_frac": 1.5}, "--cooldown-frac"),
    ({"final_lr_frac": -0.1}, "--final-lr-frac"),
    ({"muon_lr": -1.0}, "--muon-lr"),
    ({"embed_lr": float("nan")}, "--embed-lr"),
    ({"muon_momentum_warmup_steps": -1}, "--muon-momentum-warmup-steps"),
    ({"window_tokens": -1}, "--window-tokens"),
    ({"val_loss_every": -1}, "--val-loss-every"),
    ({"attention": "flash"}, "--attention"),
    ({"train_files": ""}, "--train-files"),
]


@pytest.mark.parametrize("overrides, flag", BAD, ids=[",".join(o) + "=" + str(list(o.values())) for o, _ in BAD])
def test_each_rule_rejects_with_the_flag_named(overrides, flag):
    with pytest.raises(tg.ConfigError, match=flag):
        dataclasses.replace(tg.PRESETS["cpu"], **overrides)


def test_presets_pass_their_own_rules():
    for hp in tg.PRESETS.values():
        dataclasses.replace(hp)  # re-runs __post_init__


def test_zero_warmup_steps_means_full_momentum_from_the_start():
    hp = dataclasses.replace(tg.PRESETS["cpu"], muon_momentum_warmup_steps=0)
    for step in (0, 1, 500):
        assert float(tg.muon_momentum(jnp.int32(step), hp)) == pytest.approx(0.95)
    hp = tg.PRESETS["record"]
    assert [round(float(tg.muon_momentum(jnp.int32(s), hp)), 4) for s in (0, 150, 300)] == [0.85, 0.9, 0.95]


@pytest.mark.parametrize("argv", [["--num-iterations", "0"], ["--seq-len", "-512"], ["--val-loss-every", "-1"],
                                  ["--batch-size", "-2048"]])
def test_bad_flags_exit_2_before_any_work(argv, tmp_path, capsys):
    assert tg.main([*argv, "--records-dir", str(tmp_path / "records")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: bad hyperparameters") and argv[0] in err
    assert not (tmp_path / "records").exists()


def test_a_copy_of_the_script_runs_alone_and_import_has_no_side_effects(tmp_path):
    copy = tmp_path / "attempt" / "train_gpt.py"
    copy.parent.mkdir()
    copy.write_text(open(os.path.join(ROOT, "train_gpt.py")).read())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, str(copy), "--help"], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=300)
    assert result.returncode == 0 and "--init-weights" in result.stdout, result.stderr[-2000:]
    check = ("import sys; before = list(sys.path); import train_gpt; "
             "assert sys.path == before, 'sys.path changed'; assert train_gpt.SOURCE == open(train_gpt.__file__).read()")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=copy.parent, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
