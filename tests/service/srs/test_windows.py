"""The windows a flashcard prediction reads and their feeds (nextstep/service/srs/windows.py)."""

import numpy as np
import pytest

from nextstep.service.srs.stored import ROW
from nextstep.service.srs.windows import _PAD, history_feeds


def rows(n: int, first_seq: int = 0) -> np.ndarray:
    out = np.zeros(n, dtype=ROW)
    out["seq"] = np.arange(first_seq, first_seq + n)
    out["card"], out["deck"] = out["seq"] % 7 + 1, out["seq"] % 3 + 1
    out["time"], out["duration"] = 1.7e9 + 3600.0 * out["seq"], 2.5
    out["rating"], out["state"], out["error"] = out["seq"] % 4 + 1, out["seq"] % 4, 0.25
    return out


def test_windows_are_right_aligned_each_field_its_own_column_and_the_rest_padded():
    """Three windows (5 rows, none, 8 rows) at width 8: each field's column holds the window's values at the right, the
    pad value of the field at the left, hist_valid says which; every feed contiguous, of the graph's dtype."""
    windows = [rows(5), rows(0), rows(8, 20)]
    feeds = history_feeds(windows, 8, np.array([0.5, 2.0]), params=np.ones(21), day_start=3600.0, evidence=0.1)
    for name, (fill, dtype) in _PAD.items():
        got = feeds[f"hist_{name}"]
        assert got.dtype == dtype and got.shape == (3, 8) and got.flags.c_contiguous
        for i, w in enumerate(windows):
            np.testing.assert_array_equal(got[i, 8 - len(w):], w[name].astype(dtype))
            np.testing.assert_array_equal(got[i, :8 - len(w)], np.full(8 - len(w), fill, dtype))
    np.testing.assert_array_equal(feeds["hist_valid"].sum(axis=1), [5, 0, 8])
    assert feeds["hist_valid"][0, 3:].all() and not feeds["hist_valid"][0, :3].any()
    assert feeds["drift"].shape == (3, 2) and feeds["fsrs_w"].shape == (3, 21) and feeds["evidence"].shape == (3,)


def test_a_window_of_another_dtype_is_refused():
    """A structured array of other fields (or another order) would be copied by position: refused, not misread."""
    other = np.zeros(2, dtype=[(name, ROW.fields[name][0]) for name in reversed(ROW.names)])
    with pytest.raises(TypeError, match="window 0"):
        history_feeds([other], 8, np.zeros(2))
