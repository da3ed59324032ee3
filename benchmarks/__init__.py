"""Benchmarks: naive vs optimized paths; each writes markdown + JSON under benchmarks/results/."""
