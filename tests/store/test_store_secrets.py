"""Fault injection, secrets: no password of a Redis URL is ever printed, logged, raised or kept.

A password can be given in the URL's user information (``redis://:pw@host``) or in its query
(``redis://host/0?password=pw``, which redis-py accepts). Every URL kvblend shows goes through
one function, `kvblend.store.redis.access.redacted`; this checks it on every form, then runs a real
``redis-server`` that demands a password given in the query: the store works, and neither
`RedisKVStore.url`, nor a warning, nor an error of a server killed mid-use, nor ``kvblend store
stats`` shows it. A server on this machine named as ``::ffff:127.0.0.1`` or a remote one given a
password in the query gets no "no password" warning; a remote one without gets one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvblend.cli.main import main
from kvblend.store import RedisKVStore, RemoteTieredKVStore, StoreError, default_store
from kvblend.store.redis.access import has_password, is_loopback, redacted

SECRET = "s3cret-Pa55word"

URLS = [
    f"redis://:{SECRET}@10.1.2.3:6379/0",
    f"redis://kvblend:{SECRET}@10.1.2.3:6379/0",
    f"rediss://kvblend:{SECRET}@[::1]:6380/1?ssl_cert_reqs=required",
    f"redis://10.1.2.3:6379/0?password={SECRET}",
    f"redis://10.1.2.3:6379/0?db=2&password={SECRET}&socket_timeout=5",
    f"redis://10.1.2.3:6379/0?PASSWORD={SECRET}",
    f"rediss://10.1.2.3/0?ssl_password={SECRET}&ssl_ca_certs=/etc/ca.pem",
    f"redis://10.1.2.3/0?token={SECRET}",  # an unknown parameter: hidden too
    f"unix:///run/redis.sock?password={SECRET}",
    f"redis://u:{SECRET}@10.1.2.3:6379/0#{SECRET}",
    f"redis://:{SECRET}@[::1",  # does not parse
]


@pytest.mark.parametrize("url", URLS)
def test_every_form_of_password_is_redacted(url: str) -> None:
    shown = redacted(url)
    assert SECRET not in shown and "***" in shown
    assert shown.split(":", 1)[0] == url.split(":", 1)[0]  # the scheme still says what it is


def test_what_is_not_secret_is_shown_as_it_is() -> None:
    url = "redis://kvblend@kv.internal:6379/2?db=2&socket_timeout=5&ssl_ca_certs=/etc/ca.pem"
    assert redacted(url) == url
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redacted("unix:///run/redis.sock?db=1") == "unix:///run/redis.sock?db=1"


def test_loopback_and_password_detection() -> None:
    assert all(
        map(is_loopback, ["::ffff:127.0.0.1", "127.9.9.9", "::1", "LOCALHOST", "a.localhost"])
    )
    assert not any(map(is_loopback, ["::ffff:10.1.2.3", "10.1.2.3", "fe80::1%eth0", "kv.internal"]))
    assert has_password(f"redis://10.1.2.3/0?password={SECRET}")
    assert has_password(f"redis://:{SECRET}@10.1.2.3/0")
    assert not has_password("redis://user@10.1.2.3/0?db=1")


def test_no_false_no_password_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    for url in (
        f"redis://10.255.7.1:6379/0?password={SECRET}",
        "redis://[::ffff:127.0.0.1]:6390/0",
        "redis://localhost.:6390/0",
    ):
        RedisKVStore(url)  # building does not connect
    assert "without a password" not in caplog.text
    RedisKVStore("redis://[::ffff:10.255.7.2]:6390/0")  # remote, no password: warned
    assert "without a password" in caplog.text and SECRET not in caplog.text


def test_a_password_in_the_query_is_never_shown(
    make_redis_server, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys, monkeypatch
) -> None:
    server = make_redis_server("--requirepass", SECRET)
    url = f"{server.url}?password={SECRET}"
    caplog.set_level(logging.DEBUG)
    remote = RedisKVStore(url, retry_after_s=0.05, max_retry_after_s=0.1)
    assert SECRET not in remote.url and "password=***" in remote.url
    kv = {"kv": torch.randn(2, 2, 1, 8, 4)}
    remote.put("doc", kv, {"tokens": "8"})  # authenticated with the password in the query
    entry = remote.get("doc")
    assert entry is not None and torch.equal(entry["kv"], kv["kv"])

    monkeypatch.setenv("KVBLEND_REDIS_URL", url)
    default_store(tmp_path / "kv").close()  # a local folder for the command to show
    assert main(["store", "stats", "--store-dir", str(tmp_path / "kv")]) == 0
    out = capsys.readouterr().out
    assert "redis entries: 1" in out and SECRET not in out

    wrong = RedisKVStore(f"{server.url}?password=not-{SECRET}")
    with pytest.raises(StoreError) as refused:  # a wrong password: one error, no secret in it
        wrong.get("doc")
    assert SECRET not in str(refused.value)

    store = RemoteTieredKVStore(remote=remote)
    server.kill()
    assert store.get("doc") is None  # a miss, not an exception
    errors = []
    for action in (lambda: remote.get("doc"), lambda: remote.put("doc", kv)):
        with pytest.raises(StoreError) as raised:
            action()
        errors.append(str(raised.value))
    tiered = default_store(tmp_path / "kv2", redis_url=url)
    tiered.put("other", kv)  # counted, logged
    assert tiered.stats().put_errors == 1
    shown = caplog.text + "".join(errors) + repr(remote.__dict__) + repr(tiered.stats())
    assert SECRET not in shown
    assert "password=***" in caplog.text  # the outage was logged, with the URL redacted
    store.close()
    tiered.close()
