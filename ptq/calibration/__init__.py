"""Calibration: the pipeline from samples to a quant table and its QDQ model (`pipeline`), its adjustment steps in
order (`adjustments`), the per-tensor range search (`range_search`), the int4-dsp scheme (`int4_dsp`), and
calibration over worker shards (`shards`)."""
