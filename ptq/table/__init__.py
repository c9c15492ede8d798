"""The quantization table: one JSON entry per tensor (`quant_table`), and its edits by hand or by `ptq table`
(`edit`)."""
