"""Finding where a quantized file departs from its model: per-layer comparison, sensitivity search,
verification against PyTorch."""
