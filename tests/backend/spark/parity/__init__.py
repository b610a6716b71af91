"""The differential suite: generated scenarios through Spark's own stateful operators and the drop-in."""
