"""Calibration: the pipeline from samples to a quant table and its QDQ model (`pipeline`), run as a list of steps
(`steps`): the samples and their statistics (`statistics`), the table's entries (`entries`), the weight
adjustments (`adjustments`), the per-tensor range search (`range_search`), the int4-dsp scheme (`int4_dsp`), and
calibration over worker shards (`shards`)."""
