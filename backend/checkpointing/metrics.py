"""A job's Prometheus metrics: the storage's and every materializer's registries served as one.

Why a merging collector: each materializer has a registry of its own (its metrics carry the
``operator`` and ``key_groups`` labels) and the changelog storage has one, but a scrape must see
each metric family once, with the samples of every subtask in it. The collector reads the
registries at scrape time, so subtasks started or stopped later (a restore, a rescale) are seen
without registering anything again. Serving is ``prometheus_client.start_http_server``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["MergedCollector", "MetricsServer"]


class MergedCollector(Collector):
    """The metric families of ``sources()`` (read at each scrape), one family per name."""

    def __init__(self, sources: Callable[[], Iterable[Collector]]) -> None:
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        for source in self._sources():
            for family in source.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(family.samples)
        return list(merged.values())


class MetricsServer:
    """``start_http_server`` on ``addr:port`` (0: any free port, see ``port``) for ``sources``."""

    def __init__(self, sources: Callable[[], Iterable[Collector]], port: int, addr: str = "127.0.0.1") -> None:
        self.registry = CollectorRegistry()
        self.registry.register(MergedCollector(sources))
        self._server: WSGIServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
