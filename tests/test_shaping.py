"""DAPO's overlong reward shaping: zero before the soft window, linear inside it, -penalty at the cap."""

import pytest

from jaxrl_async.rewards.shaping import overlong_penalty


@pytest.mark.parametrize(
    "length, expected",
    [
        (1, 0.0),
        (12, 0.0),  # the window's first edge: max_len - buffer
        (13, -0.25),  # inside: a quarter of the way into the 4-token window
        (14, -0.5),
        (15, -0.75),
        (16, -1.0),  # at the cap
        (20, -1.0),  # past the cap (a longer record than the cap allowed): held at -penalty
    ],
)
def test_overlong_penalty_before_inside_at_and_past_the_window(length, expected):
    assert overlong_penalty(length, max_len=16, buffer=4) == pytest.approx(expected)


def test_overlong_penalty_scales_and_turns_off():
    assert overlong_penalty(14, max_len=16, buffer=4, penalty=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(16, max_len=16, buffer=0) == 0.0  # buffer 0: no shaping at all
    assert overlong_penalty(16, max_len=16, buffer=16) == pytest.approx(-1.0)
    assert overlong_penalty(1, max_len=16, buffer=16) == pytest.approx(-1 / 16)
