"""No credential reaches a log record, even with botocore's DEBUG logging on (issue 16, defect 15).

Through a real S3 endpoint (moto's server mode): botocore logs the request headers, among them
``X-Amz-Security-Token`` and ``Authorization``, and the string it signs.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from benchmarks.support.s3_server import REGION, S3Server, create_bucket
from dstl import ChangelogConfig, S3Options, StateChangelogStorage

pytestmark = pytest.mark.s3

ACCESS_KEY = "AKIAREDACTIONTEST01"
SECRET_KEY = "secret-key-that-must-not-be-logged"
SESSION_TOKEN = "FwoGZXIvYXdzEXAMPLEsessiontokenMUSTNOTBELOGGED"


def test_debug_logging_of_requests_shows_no_credential(moto_server: S3Server, caplog: pytest.LogCaptureFixture) -> None:
    bucket = f"dstl-{uuid.uuid4().hex[:20]}"
    create_bucket(moto_server.endpoint_url, bucket)
    options = S3Options(
        endpoint_url=moto_server.endpoint_url,
        region=REGION,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        session_token=SESSION_TOKEN,
    )
    caplog.set_level(logging.DEBUG)
    with StateChangelogStorage(ChangelogConfig(base_path=f"s3://{bucket}/job", s3=options)) as storage:
        storage.files.put("chk-1/_metadata", b"meta")
        assert storage.files.get("chk-1/_metadata") == b"meta"
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert "X-Amz-Security-Token" in logged  # the headers were logged ...
    for secret in (SESSION_TOKEN, SECRET_KEY, ACCESS_KEY):
        assert secret not in logged  # ... without their values
        assert secret not in caplog.text
