"""Benchmarks: ops (fused kernels vs plain XLA), layer and model; shared timing in bench.timing."""
