"""The defaults of `ptq tune`'s validation rule (`ptq.tuning.tuner`), here so that the command line can show them
without loading the tuner and the executor."""

DEFAULT_VALIDATION_FRACTION = 0.3  # every k-th sample, k = round(1 / fraction), decides; the rest is fitted on
DEFAULT_MARGIN = 0.0  # the validation figure must reach target + margin ...
DEFAULT_Z = 2.0  # ... at its mean minus z standard errors
# the views (ptq.data.views) each validation photo enters with
DEFAULT_VIEWS = ("photo", "mirror", "zoom", "low-res", "low-contrast", "dark", "bright")
INT4_ROUNDINGS = ("nearest", "adaround", "gptq")  # how `--scheme int4-dsp` may round its 4-bit weights
