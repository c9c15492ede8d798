"""The ground floor of ptq: the graph IR over ONNX, quantization parameters, the M/2^N requant helper, the
weight/bias role types and the bias and clip-bound helpers that calibration, the ops and the QDQ export share;
and the helpers every floor uses: atomic writes (`atomic`), notes to the user (`notes`) and the command line's
option defaults (`option_defaults`, importing nothing so that building the parser loads no machinery).

Everything else in the project stands on this package; it imports nothing of the project outside itself
(`tests/test_layers.py` walks the imports and fails on any other arrow).
"""
