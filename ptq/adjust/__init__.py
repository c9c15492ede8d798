"""Weight adjustments, one algorithm a module: BatchNorm folding with its statistics, cross-layer equalization
and bias absorption, empirical and analytic bias correction, AdaRound, and the adjusted model written beside the
table."""
