"""hr_dyn_admit's one argument is declared once on each side: the C struct
(native/dynamic_map.c, hr_dyn_admit_args) and its ctypes mirror (kernels/native_map.py,
AdmitArgs) must agree field for field, or C reads the wrong words. The C library reports its
field names, sizeof and offsets; they must be ctypes'."""

from __future__ import annotations

import pytest

from hybridrec.kernels import native, native_map

pytestmark = pytest.mark.skipif(native.lib() is None, reason="no C compiler: no native path")


def test_the_ctypes_mirror_has_the_c_structs_layout():
    names, layout = native_map.admit_layout()
    fields = native_map.AdmitArgs._fields_
    assert names == [name for name, _ in fields]
    offsets = [getattr(native_map.AdmitArgs, name).offset for name, _ in fields]
    assert layout == [native_map.ctypes.sizeof(native_map.AdmitArgs), *offsets]
    assert len(names) == 29  # hr_dyn_admit's former positional arguments, one struct now
