"""What both clients' ``stream`` do when the stream is lost (``_retry_or_raise``): give
up, or how long to wait and which ``reconnecting`` notice to yield. No server: the
jitter is given, so every value is exact."""

from __future__ import annotations

import pytest

from mlwe.client import ServerUnreachable, StreamEvent
from mlwe.client.streams import _Retry, _retry_or_raise

URL = "http://mlwe.test:8080"


def test_without_reconnect_the_first_loss_raises_with_the_reason() -> None:
    with pytest.raises(ServerUnreachable) as err:
        _retry_or_raise(URL, "the server closed the stream", 0, reconnect=False, max_retries=None,
                        notices=True, rand=lambda: 0.5)
    assert err.value.url == URL
    assert err.value.detail == f"cannot reach the server at {URL}: the server closed the stream"


def test_a_retry_counts_the_failure_waits_with_backoff_and_says_so() -> None:
    assert _retry_or_raise(URL, "boom", 0, reconnect=True, max_retries=3, notices=True,
                           rand=lambda: 0.5) == _Retry(
        1, 0.5, StreamEvent("reconnecting", None, {"message": "boom; again in 0.5 s", "attempt": 1})
    )
    # the third failure in a row: 0.5 * 2**2 s, times the least jitter (0.75)
    assert _retry_or_raise(URL, "boom", 2, reconnect=True, max_retries=3, notices=True,
                           rand=lambda: 0.0) == _Retry(
        3, 1.5, StreamEvent("reconnecting", None, {"message": "boom; again in 1.5 s", "attempt": 3})
    )


def test_the_wait_is_capped_and_without_notices_there_is_none() -> None:
    # the 11th failure: 0.5 * 2**10 = 512 s, capped at 30 s; no limit on retries
    assert _retry_or_raise(URL, "boom", 10, reconnect=True, max_retries=None, notices=False,
                           rand=lambda: 0.5) == _Retry(11, 30.0, None)
    assert _retry_or_raise(URL, "boom", 10, reconnect=True, max_retries=None, notices=False,
                           rand=lambda: 1.0).wait == 37.5


def test_more_failures_in_a_row_than_max_retries_give_up() -> None:
    assert _retry_or_raise(URL, "boom", 2, reconnect=True, max_retries=3, notices=False,
                           rand=lambda: 0.5).failures == 3
    with pytest.raises(ServerUnreachable) as err:
        _retry_or_raise(URL, "boom", 3, reconnect=True, max_retries=3, notices=False,
                        rand=lambda: 0.5)
    assert err.value.detail == f"cannot reach the server at {URL}: boom (gave up after 3 retries)"
    with pytest.raises(ServerUnreachable, match=r"boom \(gave up after 0 retries\)"):
        _retry_or_raise(URL, "boom", 0, reconnect=True, max_retries=0, notices=True,
                        rand=lambda: 0.5)
