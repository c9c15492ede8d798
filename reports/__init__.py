"""Similarity metrics, per-layer quantization reports (json/csv/html), bottleneck ranking, fake-quant debug."""
