"""The inference engine weightstream ships: an HTTP server with TP workers that loads our buckets (tests, demo,
benchmarks)."""
