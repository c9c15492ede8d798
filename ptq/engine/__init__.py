"""Preparing and running the integer graph: the rewrites that fold and fuse the float graph (`rewrites`,
`transformer_patterns`, `graph_edit`), the executor (`executor`: quantize rules, integer steps, float fallbacks),
the dot-product backends by name, weights and their scale floors, and the float run in onnxruntime (`float_run`)."""
