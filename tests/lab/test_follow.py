"""`plot(follow=True)` from a second client and `history()`'s columns, against a real control plane."""

from __future__ import annotations

import pandas as pd
import pytest

from openrl_lab.lab import Lab


@pytest.fixture(scope="module")
def alice(lab):
    client = Lab.connect(lab.base_url, api_key=lab.api_key, home=lab.home)
    yield client
    client.close()


def test_history_time_is_datetimes(alice):
    run = alice.lease("hist-time", rank=2)
    assert str(run.history()["time"].dtype) == "datetime64[ns, UTC]"  # empty, same columns
    run.log(0, reward=0.5)
    history = run.history()
    assert pd.api.types.is_datetime64_any_dtype(history["time"])
    assert abs(history["time"].iloc[0] - pd.Timestamp.now(tz="UTC")) < pd.Timedelta(minutes=5)
    alice.release("hist-time")


def test_a_follower_gets_the_last_steps_then_stops_on_release(lab, alice, capsys):
    run = alice.lease("followed", rank=2)
    run.log(0, reward=0.0)
    run.flush()
    other = Lab.connect(lab.base_url, api_key=lab.api_key)
    follower = other.attach("followed")
    plot = follower.plot(["reward"], follow=True, autostart=False)
    thread = next(t for t in __import__("threading").enumerate() if t.name == "openrl-follow-followed")
    for step in range(1, 6):  # logged and released at once: the rows reach the server only with the release
        run.log(step, reward=step / 10)
    alice.release("followed")
    thread.join(timeout=10)
    assert not thread.is_alive(), "the follower kept polling a released lease"
    assert plot.dataframe["step"].tolist() == [0, 1, 2, 3, 4, 5]
    assert "followed: the lease was released; the plot stops at step 5." in capsys.readouterr().out
    plot.close()
    other.close()


def test_a_follower_stops_when_its_plot_is_closed(lab, alice):
    run = alice.lease("followed-2", rank=2)
    plot = run.plot(["reward"], follow=True, autostart=False)
    thread = next(t for t in __import__("threading").enumerate() if t.name == "openrl-follow-followed-2")
    plot.close()
    thread.join(timeout=5)
    assert not thread.is_alive()
    alice.release("followed-2")
