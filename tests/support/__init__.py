"""What the tests share, none of it a test: helpers used by the tests of several packages, the child
programs tests start (``python -m tests.support.<name>_child``, cwd: the project root) and the S3
server the S3 tests talk to (``s3``; the fixtures themselves are in ``tests/conftest.py``).

Where a test helper lives:

- used by the tests of one package: a non-test module in that package's test folder (e.g.
  ``tests/backend/checkpointing/workloads.py``);
- used by the tests of several packages, or started as a child process: here;
- a pytest fixture: the ``conftest.py`` of the folder whose tests use it.

No test imports a ``test_*.py`` module or a ``conftest.py``: helpers are imported from their
module, fixtures reach tests through pytest.
"""
