"""portakern.arrays: host copies of device arrays, whatever their strides."""

from __future__ import annotations

import numpy as np
import pytest

from opencl_helpers import require_opencl
from portakern.arrays import to_numpy


@pytest.mark.parametrize("view", ["rows reversed", "a column", "every other column of two rows",
                                  "reversed every other row", "an empty column"])
def test_a_strided_pyopencl_view_reads_back_its_own_values(view):
    # pyopencl's get() refuses views that are not contiguous; the host copy takes the view's bytes at its strides
    import pyopencl.array as cla

    _, queue = require_opencl()
    host = np.arange(24, dtype=np.int32).reshape(4, 6) * 7 - 50
    dev = cla.to_device(queue, host)
    pick = {"rows reversed": np.s_[::-1], "a column": np.s_[:, 1], "every other column of two rows": np.s_[1:3, ::2],
            "reversed every other row": np.s_[::-2, 1:], "an empty column": np.s_[:0, 1]}[view]
    got = to_numpy(dev[pick])
    assert got.dtype == np.int32 and got.shape == host[pick].shape
    np.testing.assert_array_equal(got, host[pick])
