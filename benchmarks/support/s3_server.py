"""A real S3-compatible HTTP server for tests and benchmarks: moto's server mode on 127.0.0.1.

Only S3 is served (moto's S3 application without its multi-service dispatcher, see ``_main``):
no ``/moto-api``, no other AWS service.

It runs in a subprocess (its own GIL, like a real remote store) bound to port 0; the child prints
``PORT <n>`` once it listens and exits when its stdin closes, so it cannot outlive the parent.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"


@dataclass
class S3Server:
    process: subprocess.Popen[str]
    port: int

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_s3_server() -> S3Server:
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.support.s3_server"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("PORT "):
        process.kill()
        raise RuntimeError(f"moto server did not start (printed {line!r})")
    return S3Server(process, int(line.split()[1]))


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()


def create_bucket(endpoint_url: str, bucket: str) -> None:
    """Create a bucket with plain botocore (synchronous; only for setting up tests)."""
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)


def list_keys(endpoint_url: str, bucket: str, prefix: str = "") -> list[str]:
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(obj["Key"] for obj in page.get("Contents", []))
    return keys


def _main() -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    # moto's own S3 application and request handler, served by werkzeug's threaded server as
    # moto's ThreadedMotoServer does, minus its DomainDispatcherApplication: that one finds the
    # service of every request by listing moto's package directory (one stat per module, ~150)
    # under a global lock, serialized across requests (py-spy; docs/benchmarks.md has the share):
    # it inflated every S3 request's latency in tests and benchmarks.
    server = make_server("127.0.0.1", 0, create_backend_app("s3"), threaded=True, request_handler=MotoRequestHandler)
    # moto's modules are many long-lived objects that every full collection of the cyclic GC
    # walks: a stall of every request in flight that no real store has. Freezing them keeps the
    # collector to the objects of requests.
    gc.collect()
    gc.freeze()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"PORT {server.server_address[1]}", flush=True)
    sys.stdin.read()  # returns when the parent closes our stdin or dies
    server.shutdown()
    thread.join()


if __name__ == "__main__":
    _main()
