"""The private core every layer stands on: files and folders (io), the onnx_ir graph layer (ir),
model inputs (inputs), symbolic axes (axes), torch helpers, the CPU's INT8 kernels (cpu), the one
call of torch.onnx.export (capture) and the post-conditions every export checks (checks)."""
