"""`ptq tune`: reaching a target cosine with 16-bit tensors, better ranges and float layers (`tuner`), its
validation data (`data`), its defaults (`defaults`) and its passes over worker shards (`shards`)."""
