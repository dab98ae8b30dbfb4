"""Schedules at the spec's exact steps (record 20: 1393 steps, cooldown 0.4, window 1728 tokens)."""
import numpy as np

import train_gpt as tg

HP = tg.PRESETS["record"]


def test_window_blocks_change_exactly_at_the_spec_steps():
    windows = [tg.window_blocks(s, HP) for s in range(HP.num_iterations + 1)]
    changes = {s: w for s, w in enumerate(windows) if s == 0 or w != windows[s - 1]}
    assert changes == {0: 1, 104: 2, 207: 3, 310: 4, 413: 5, 516: 6, 620: 7, 723: 8, 826: 9, 929: 10,
                       1032: 11, 1136: 12, 1239: 13, 1342: 14}
    assert windows[1393] == 14 and windows[1393] // 2 == 7  # final validation: long 14, short 7


def test_lr_factor_knee_and_end():
    f = lambda s: float(tg.lr_factor(s, HP))  # noqa: E731
    assert f(0) == 1.0 and f(835) == 1.0
    assert f(836) < 1.0
    np.testing.assert_allclose(f(836), (1 - 836 / 1393) / 0.4 * 0.9 + 0.1, rtol=1e-6)
    np.testing.assert_allclose(f(1392), 0.1 + 0.9 * (1 / 1393) / 0.4, rtol=1e-6)  # ≈ 0.1016
    assert abs(f(1392) - 0.1016) < 1e-4


def test_muon_momentum_warmup():
    m = lambda s: float(tg.muon_momentum(s, HP))  # noqa: E731
    np.testing.assert_allclose([m(0), m(150), m(300), m(301), m(1000)], [0.85, 0.90, 0.95, 0.95, 0.95], rtol=1e-6)
