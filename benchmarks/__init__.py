"""Benchmarks: ``python -m benchmarks NAME [--quick] [--json PATH]``.

Each benchmark measures side by side in one run and reports ratios where the machine's noise
would make absolute figures meaningless. Results go to JSON (``metrics`` holds the figures the
issues name) and, where a curve says more than a number, a PNG beside it.
"""
