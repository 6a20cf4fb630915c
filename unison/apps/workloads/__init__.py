"""Training workloads shared by benchmarks and tests: real data and models, nothing downloaded.

``charlm``: a small causal transformer learning characters of the Python
standard library's own source files.
"""
