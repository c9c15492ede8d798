"""The choices and defaults of the command line's options, in a module that imports nothing: building the
parser (`ptq --help`, `ptq CMD --help`, and every command before it runs) must not load the machinery that
uses them. The modules that own these values import them from here (`ptq.calibration.pipeline`, `ptq.calibration.int4_dsp`,
`ptq.api`, `ptq.data.images`, `reports.dsp_resources`)."""

# auto (calibrators/methods/auto.py): each activation's range chosen per tensor by its expected error on its real
# grid, never clipping what a Softmax/ArgMax or the user ranks, scored on what a MaxPool passes on. It beats NNCF's
# best on all four families of bench/first_try.py and extrema on DBNet and the tagger, ties it on the CRNN
# decode; it trails extrema by noise-sized amounts on Lite0 and MobileNetV3-small and by 1e-4 on YOLO's output
# cosine (its recall is higher): its docstring's table. extrema missed NNCF on DBNet (0.999876 against 0.999877).
DEFAULT_CALIBRATOR = "auto"
DEFAULT_WEIGHT_CALIBRATOR = "extrema"
DEFAULT_SCHEME = "default"
INT4_DSP_SCHEME = "int4-dsp"  # Xilinx WP521's 4-bit scheme (`ptq.calibration.int4_dsp`)
SCHEMES = (DEFAULT_SCHEME, INT4_DSP_SCHEME)

LAYOUTS = ("NCHW", "NHWC")  # input layouts of --images

DEFAULT_ISOLATED_IMAGES = 2  # images the report's isolated metrics cover by default

DEFAULT_DSPS = 2520  # every DSP48E2 slice of the ZCU102's XCZU9EG (the WP521 evaluation board)
DEFAULT_CLOCK_MHZ = 300.0  # WP521's 4-bit XDPU clock

REPORT_TASKS = ("auto", "classify", "detect")  # `ptq report --task` (`reports.detections`)
DEFAULT_SCORE_THRESHOLD = 0.25  # detections kept for the comparison (`reports.detections`)
DEFAULT_MATCH_IOU = 0.5  # an integer detection matches a float one of its class at this IoU or more
