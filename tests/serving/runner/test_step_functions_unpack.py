"""The field table's two directions agree: every field of a laid-out step, packed into the
three int32 buffers on the host (HostStep.packed) and unpacked by name on device
(step_functions.unpack), comes back with its dtype and every value, floats bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.serving.runner.test_host_step import mixed_step
from xlaserve.serving.runner.host_step import ROW_FIELDS, TOKEN_FIELDS
from xlaserve.serving.runner.step_functions import unpack


def test_every_field_round_trips_through_the_packed_buffers() -> None:
    h = mixed_step()
    rows, toks, tables = h.packed()
    assert rows.dtype == toks.dtype == np.int32 and np.array_equal(tables, h.block_tables)
    for packed, fields in ((rows, ROW_FIELDS), (toks, TOKEN_FIELDS)):
        back = unpack(jnp.asarray(packed), fields)
        assert list(back) == [f.name for f in fields]
        for f in fields:
            want, got = getattr(h, f.name), np.asarray(back[f.name])
            assert got.dtype == want.dtype, f.name
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f.name


def test_a_buffer_of_the_wrong_height_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="cannot hold the 4 fields"):
        unpack(jnp.zeros((3, 5), jnp.int32), TOKEN_FIELDS)
