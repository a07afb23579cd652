"""Benchmarks and endurance runs behind ``weightstream bench``."""
