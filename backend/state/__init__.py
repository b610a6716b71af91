"""Keyed state of one subtask: the key context, LMDB tables, state tables and wrappers, timers, restore.

``keyed_backend.ChangelogKeyedStateBackend`` ties the modules together; ``backend`` exports the API.
"""
