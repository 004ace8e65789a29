"""Credentials in URLs never reach a log line, /healthz or a config's repr
(``libs/common/redact.py``)."""

from __future__ import annotations

import logging

import pytest

from libs.common.config import ServiceConfig
from libs.common.redact import install_log_redaction, redact, redact_text


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # nothing secret: unchanged
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("http://host/bucket/key@v2?versionId=3", "http://host/bucket/key@v2?versionId=3"),
        ("unix:///run/redis.sock?db=1", "unix:///run/redis.sock?db=1"),
        ("", ""),
        # user and password
        ("nats://user:pass@host:4222", "nats://user:***@host:4222"),
        ("redis://:s3cret@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://default:pw@[::1]:6380", "rediss://default:***@[::1]:6380"),
        # a lone user part is a NATS token or an API key
        ("nats://s3cr3tT0ken@host:4222", "nats://***@host:4222"),
        # '@' and ':' inside the password: everything up to the authority's last '@'
        ("nats://user:p:w@host:4222", "nats://user:***@host:4222"),
        ("nats://user:p@ss:w@rd@host:4222", "nats://***@host:4222"),
        ("nats://p@ss:w@rd@host:4222", "nats://***@host:4222"),
        ("nats://user:p%40ss@host:4222/x", "nats://user:***@host:4222/x"),
        # no scheme (NATS accepts user:pass@host:port)
        ("user:pass@host:4222", "user:***@host:4222"),
        # secret query values, whatever the scheme
        ("http://s3:8333/b?token=abc&x=1", "http://s3:8333/b?token=***&x=1"),
        ("redis://host/0?password=hunter2", "redis://host/0?password=***"),
        (
            "https://b.s3/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=ff&X-Amz-Expires=60",
            "https://b.s3/k?X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Expires=60",
        ),
        ("http://h/?api_key=k#frag", "http://h/?api_key=***#frag"),
        ("http://u:p@h/?secret=s", "http://u:***@h/?secret=***"),
    ],
)
def test_redact_hides_passwords_tokens_and_secret_query_values(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize(
    "secret", ["pass", "p@ss:w@rd", "s3cr3tT0ken", "hunter2", "AKIA%2F1", "ff00"]
)
def test_no_secret_survives_in_text(secret: str) -> None:
    text = (
        f"connecting to nats://user:{secret}@n1:4222, 'redis://:{secret}@r:6379/0' and "
        f"<http://s3/b?token={secret}> then nats://{secret}@n2:4222\n(retrying)"
    )
    shown = redact_text(text)
    assert secret not in shown
    user = "user:" if "@" not in secret else ""  # an '@' in it hides the user name too
    colon = ":" if "@" not in secret else ""
    assert f"nats://{user}***@n1:4222," in shown and f"'redis://{colon}***@r:6379/0'" in shown
    assert "<http://s3/b?token=***>" in shown and "nats://***@n2:4222\n(retrying)" in shown


def test_service_config_repr_shows_no_password() -> None:
    cfg = ServiceConfig(nats_url="nats://svc:hunter2@nats:4222", instance_id="x")
    assert "hunter2" not in repr(cfg) and "hunter2" not in str(cfg)
    assert "nats_url='nats://svc:***@nats:4222'" in repr(cfg)
    assert "instance_id='x'" in repr(cfg)
    with pytest.raises(ValueError) as err:
        ServiceConfig(nats_url="http://svc:hunter2@nats:4222")
    assert "hunter2" not in str(err.value) and "http://svc:***@nats:4222" in str(err.value)


def test_every_log_record_is_redacted(caplog: pytest.LogCaptureFixture) -> None:
    install_log_redaction()
    install_log_redaction()  # idempotent
    log = logging.getLogger("test.redact")
    with caplog.at_level(logging.INFO):
        log.info("NATS %s up; cfg %r", "nats://u:hunter2@h:4222", {"url": "redis://:hunter2@r"})
        try:
            raise ConnectionError("cannot reach nats://u:hunter2@h:4222")
        except ConnectionError:
            log.exception("failed")
        log.info("%d%%", 5)  # plain formatting still works
    assert "hunter2" not in caplog.text
    assert "nats://u:***@h:4222" in caplog.text and "redis://:***@r" in caplog.text
    assert "5%" in caplog.text
