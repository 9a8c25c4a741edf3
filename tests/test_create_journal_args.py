"""``Channel.create``'s journal settings (``fsync``, ``fsync_interval``, ``max_journal_bytes``)
are refused without ``journal=``, as ``zchannel broker`` refuses its flags and a config file its
keys without a journal: they would do nothing, and the channel would not be durable."""

from __future__ import annotations

import pytest
from zchannel.broker import Channel, ChannelNotFound


def _create_expecting_value_error(name: str, **kwargs) -> ValueError:
    """The ``ValueError`` of ``Channel.create(name, **kwargs)`` (a channel it made anyway is
    shut down before the test fails)."""
    try:
        made = Channel.create(name, **kwargs)
    except ValueError as exc:
        return exc
    durable = made.stats().get("journal") is not None
    made.shutdown()
    pytest.fail(f"Channel.create({name!r}, {kwargs}) made a channel (durable: {durable}) "
                "instead of raising ValueError")


def _nothing_serves(name: str) -> bool:
    try:
        Channel.connect(name, timeout=0).close()
    except ChannelNotFound:
        return True
    return False


@pytest.mark.parametrize("settings", [
    {"fsync": "always"},
    {"fsync": "interval"},  # the default policy, given: still a setting that does nothing
    {"fsync_interval": 0.5},
    {"max_journal_bytes": 1 << 30},
    {"fsync": "never", "fsync_interval": 0.5, "max_journal_bytes": 1 << 30},
])
def test_journal_settings_without_a_journal_are_refused(run_dir, settings):
    exc = _create_expecting_value_error("nojournal", **settings)
    message = str(exc)
    assert f"{', '.join(settings)} set(s) the journal of a durable channel" in message
    assert "give journal=DIR too" in message and "not durable" in message
    assert _nothing_serves("nojournal")


def test_journal_settings_on_a_local_channel_are_refused(run_dir):
    exc = _create_expecting_value_error("nojournal", fsync="always", local=True)
    assert "fsync set(s) the journal of a durable channel: a local channel has none" in str(exc)


@pytest.mark.parametrize("journal", [False, True])
@pytest.mark.parametrize("fsync", ["sometimes", "ALWAYS", 1, ""])
def test_an_fsync_that_is_no_policy_is_refused_with_or_without_a_journal(run_dir, tmp_path,
                                                                         journal, fsync):
    kwargs = {"journal": str(tmp_path / "j")} if journal else {}
    exc = _create_expecting_value_error("badfsync", fsync=fsync, **kwargs)
    assert f"fsync must be one of always, interval, never, got {fsync!r}" in str(exc)
    assert _nothing_serves("badfsync")
    assert not (tmp_path / "j").exists()


@pytest.mark.parametrize("settings", [{"fsync_interval": 0}, {"fsync_interval": float("nan")},
                                      {"max_journal_bytes": -1}])
def test_journal_numbers_out_of_range_are_refused_without_a_journal_too(run_dir, settings):
    """A number out of its range is refused for its range first, as the CLI does."""
    (setting, _value), = settings.items()
    exc = _create_expecting_value_error("badnumber", **settings)
    assert str(exc).startswith(f"{setting} must be"), str(exc)


def test_journal_settings_with_a_journal_apply_and_default(run_dir, tmp_path):
    """With ``journal=`` the settings given apply, and those not given take their defaults
    (``fsync="interval"`` every 0.01 s, no byte limit)."""
    given = Channel.create("withjournal", journal=tmp_path / "a", fsync="always",
                           max_journal_bytes=1 << 30)
    try:
        stats = given.stats()["journal"]
        assert (stats["fsync"], stats["max_journal_bytes"]) == ("always", 1 << 30)
    finally:
        given.shutdown()
    defaults = Channel.create("withdefaults", journal=tmp_path / "b")
    try:
        stats = defaults.stats()["journal"]
        assert (stats["fsync"], stats["fsync_interval_ms"], stats["max_journal_bytes"]) == (
            "interval", 10.0, 0)
    finally:
        defaults.shutdown()
