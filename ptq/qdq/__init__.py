"""The QDQ ONNX model of a quant table: export (`export`), codes for a target runtime (`targets`), the check in
onnxruntime (`check`), and export, check and atomic write as one step (`output`)."""
