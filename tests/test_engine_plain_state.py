"""The engine's plain state in a checkpoint (issue 48, class 3): every counter a rank's
entry holds is checked for type and range when the state is unpacked, before anything is
restored, and refused in one line naming the entry and the field."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from editrain.errors import CheckpointError
from editrain.sync.state import PLAIN_STATE_SCHEMA, json_tensor, read_plain_state

GOOD = {"version": 3, "topology": [2, 2], "global_step": 8, "steps_since_sync": 0,
        "num_syncs": 2, "num_skipped_syncs": 0, "num_syncs_forced": 0, "next_index": 2,
        "synced_replica_steps": 16.0, "last_window_s": 0.0, "spent": False,
        "rng": {"seed": 1234}, "stateful_units": [0, 1], "unit_names": ["a", "b"],
        "detectors": None, "loss": None}
COUNTERS = ["global_step", "steps_since_sync", "num_syncs", "num_skipped_syncs",
            "num_syncs_forced", "next_index"]
HOSTILE = [10**18, -1, 1.5, math.nan, math.inf, True, "8", None, [8], {"n": 8}]


def test_a_saved_state_reads_back():
    assert read_plain_state(json_tensor(GOOD), "rank00000") == GOOD


@pytest.mark.parametrize("field", COUNTERS)
@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_every_counter_is_checked(field, value):
    with pytest.raises(CheckpointError) as info:
        read_plain_state(json_tensor({**GOOD, field: value}), "rank00003")
    msg = str(info.value)
    assert "rank00003" in msg and repr(field) in msg and "\n" not in msg


@pytest.mark.parametrize("field", sorted(PLAIN_STATE_SCHEMA.required))
def test_a_missing_field_is_named(field):
    bad = {k: v for k, v in GOOD.items() if k != field}
    with pytest.raises(CheckpointError, match=f"field {field!r} is missing"):
        read_plain_state(json_tensor(bad), "rank00000")


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from([*COUNTERS, "synced_replica_steps", "last_window_s"]),
       value=st.one_of(st.integers(), st.floats(allow_nan=True), st.text(max_size=80),
                       st.booleans(), st.none()))
@example(field="last_window_s", value=10**12 + 1)  # an integer past a time's range
@example(field="last_window_s", value=10**12)
@example(field="global_step", value=2**53 + 1)
@example(field="synced_replica_steps", value=2**53)
def test_any_value_is_accepted_only_in_range(field, value):
    """Whatever a counter or time holds, it is either a number in range (and read back
    as it was) or refused by name; no value gets through to the engine unchecked."""
    state = {**GOOD, field: value}
    timed = field in ("synced_replica_steps", "last_window_s")
    ok = (not timed and type(value) is int and 0 <= value <= 2**53) or (
        timed and type(value) in (int, float) and math.isfinite(value)
        and 0 <= value <= (2.0**53 if field[0] == "s" else 1e12))
    if ok:
        assert read_plain_state(json_tensor(state), "rank00000")[field] == value
    else:
        with pytest.raises(CheckpointError, match=repr(field)):
            read_plain_state(json_tensor(state), "rank00000")
