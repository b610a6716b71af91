"""Periodic and size-triggered snapshots of the LMDB tables to the DFS; truncation of the log."""
