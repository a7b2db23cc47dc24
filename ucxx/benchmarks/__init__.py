"""Benchmarks of ucxx: ``python -m ucxx.benchmarks.send_recv --help``."""
