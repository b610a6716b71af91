"""``python -m dstl.service --socket PATH [--idle-timeout-ms N] [--epoch N]``: run a changelog service.

The configuration arrives as JSON on stdin (``dstl.service.configjson``), never on the command
line or in a file: it may hold S3 secrets. Once listening, the service prints one line,
``READY <pid> <epoch>``, on stdout and then points stdout at /dev/null, so the process that
started it may close its end of the pipe. Logs go to stderr (the client that starts a service
sends them to ``<socket>.log``). SIGTERM and SIGINT close the service gracefully: connections are
dropped, uploads are flushed, the socket is unlinked. Exit status 0 after a clean stop, 2 when
the configuration or arguments are refused, 1 when the service could not start or its final
flush or close failed. If nobody reads the ``READY`` line (its starter died), the service logs
it and serves on: other workers may use it, and it exits once idle.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType

from dstl.errors import ChangelogError
from dstl.service.configjson import loads_config
from dstl.service.server import ChangelogService


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dstl.service", description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, help="the Unix socket to listen on")
    parser.add_argument(
        "--idle-timeout-ms", type=int, default=60_000, help="exit after this long without clients (0: never)"
    )
    parser.add_argument("--epoch", type=int, default=None, help="this start's epoch (default: take the next one)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("dstl.service")
    try:
        config = loads_config(sys.stdin.buffer.read().decode("utf-8", errors="replace"))
        service = ChangelogService(config, args.socket, idle_timeout_ms=args.idle_timeout_ms or None, epoch=args.epoch)
    except ChangelogError as exc:
        log.error("refused to start on %s: %s", args.socket, exc)
        return 2
    try:
        service.start()
    except (ChangelogError, OSError) as exc:
        log.error("could not start on %s: %s", args.socket, exc)
        return 1

    def close() -> None:
        with contextlib.suppress(Exception):  # logged, and kept in close_error
            service.close()

    def stop(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: closing", signum)
        threading.Thread(target=close, name="dstl-svc-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        print(f"READY {os.getpid()} {service.epoch}", flush=True)
    except BrokenPipeError:
        log.warning("nobody reads the READY line on %s (its starter is gone): serving on", args.socket)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    service.serve_forever()
    if service.close_error is not None:
        log.error("stopped on %s, but the final flush or close failed: %r", args.socket, service.close_error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
