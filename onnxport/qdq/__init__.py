"""Faithful Q/DQ export of pt2e-quantized models, and what a Q/DQ file contains."""
