"""onnxport benchmarks: ours against the baseline, measured side by side in one run."""
