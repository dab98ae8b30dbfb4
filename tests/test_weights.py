"""Weights interop: .npz files keyed by the PyTorch state-dict names (--save-weights, --init-weights)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import train_gpt as tg

SMALL = dataclasses.replace(tg.PRESETS["cpu"], model_dim=256, num_heads=2, seq_len=512, vocab_size=1024)  # every name


def random_params(hp, rng):
    """Every value random (in each parameter's dtype), so a swapped or dropped array shows."""
    return {k: jnp.asarray(rng.standard_normal(p.shape), p.dtype) for k, p in tg.init_params(hp, 0).items()}


def test_npz_round_trip_is_exact_and_mismatches_are_rejected(tmp_path):
    rng = np.random.default_rng()
    params = random_params(SMALL, rng)
    path = str(tmp_path / "w.npz")
    tg.save_weights(params, path)
    with np.load(path) as f:
        assert f["blocks.0.attn.qkv_w"].shape == (3, 256, 256) and f["blocks.0.mlp.c_fc.weight"].shape == (1024, 256)
    loaded = tg.load_weights(path, SMALL)
    assert loaded.keys() == params.keys()
    for k in params:
        assert loaded[k].dtype == params[k].dtype
        np.testing.assert_array_equal(np.asarray(loaded[k], np.float32), np.asarray(params[k], np.float32))
    with pytest.raises(tg.DataError, match="wrong shapes.*embed.weight"):
        tg.load_weights(path, dataclasses.replace(SMALL, model_dim=128, num_heads=1))


@pytest.mark.parametrize("case", ["not_npz", "folder"])
def test_bad_weight_paths_exit_2_before_compiling(case, tiny_args, tmp_path, capsys):
    if case == "not_npz":
        (tmp_path / "w.npz").write_text("not an npz")
        flags, expect = ["--init-weights", str(tmp_path / "w.npz")], "written by --save-weights"
    else:
        flags, expect = ["--save-weights", str(tmp_path)], "is a folder"
    assert tg.main(tiny_args(tmp_path / "records") + flags) == 2
    assert expect in capsys.readouterr().err
    assert not (tmp_path / "records").exists() or not any((tmp_path / "records").iterdir())
