"""The exporters: float (export_onnx), Q/DQ (export_qdq), its weight-only path, and the translation
of pt2e's operators. Each is a plan that the engine (onnxport.engine) runs."""
