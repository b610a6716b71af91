"""Credentials out of every log record: a log record factory that redacts secrets and auth headers.

At DEBUG, botocore and urllib3 log request headers (``X-Amz-Security-Token``, ``Authorization``),
request parameters and the string to sign. A ``logging.Filter`` on the ``botocore`` logger does not
see records of ``botocore.endpoint`` (filters of a logger apply only to its own records), and one on
the handlers misses handlers added later (a test's ``caplog``, an application's own). The record
factory sees every record of the process once it is enabled, so that is where secrets are taken
out; a disabled level costs nothing (records are not even created).

Known secret values (the access key id, the secret key, the session token) are replaced wherever
they appear, and the values of the auth headers and credential fields are replaced by pattern, so
a credential the process never told us about (one botocore resolved itself) is covered too.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

__all__ = ["REDACTED", "install_redaction", "redact"]

REDACTED = "<redacted>"

#: header or field name, separator, then the value up to the closing quote or the end of the line
_FIELDS = re.compile(
    r"(?i)((?:x-amz-security-token|authorization|aws_secret_access_key|aws_session_token|aws_access_key_id"
    r"|secretaccesskey|sessiontoken|accesskeyid|x-amz-credential|x-amz-signature|signature)"
    r"['\"]?\s*[:=]\s*b?['\"]?)([^'\",}\n]+)"
)

_lock = threading.Lock()
#: replaced as a whole (never mutated), so ``redact`` reads it without the lock
_secrets: tuple[str, ...] = ()
_installed = False


def redact(text: str) -> str:
    """``text`` with every known secret and every auth header or credential value replaced."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return _FIELDS.sub(lambda m: m.group(1) + REDACTED, text)


def install_redaction(*secrets: str | None) -> None:
    """Redact these values (and auth headers) from every log record from now on; idempotent."""
    global _installed, _secrets
    with _lock:
        _secrets = tuple({*_secrets, *(s for s in secrets if s and len(s) >= 4)})
        if _installed:
            return
        _installed = True
        previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: leave it for logging to report
            return record
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return record

    logging.setLogRecordFactory(factory)
