"""Keyed state on LMDB that logs every change to the DSTL."""
