"""The QDQ model's flags, the same for every command that writes one (`calibrate`, `tune`, `table export`):
`--qdq-target` (`calibrate` also spells it `--target`, its original name) and `--no-check`."""
from __future__ import annotations

import argparse

from ptq.qdq.targets import DEFAULT_TARGET, QDQ_TARGETS


CHECK_HELP = ("do not run the QDQ model in onnxruntime (optimizations off and on) against the float model on a few "
              "of the samples (--quiet skips it too)")


def add_qdq_arguments(parser: argparse.ArgumentParser, *spellings: str, check_help: str = CHECK_HELP) -> None:
    """A "QDQ model" group: the target (`--qdq-target` plus `spellings`; dest `target`) and `--no-check`
    (`check_help`: what it skips in this command)."""
    qdq = parser.add_argument_group("QDQ model")
    qdq.add_argument(*spellings, "--qdq-target", dest="target", default=DEFAULT_TARGET, type=str.lower,
                     choices=list(QDQ_TARGETS), metavar="TARGET",
                     help=f"the runtime the QDQ model is stored for, listed below (default: {DEFAULT_TARGET}); "
                          f"the quantization table does not depend on it")
    qdq.add_argument("--no-check", action="store_true", help=check_help)


def qdq_targets_epilog(flag: str = "--qdq-target") -> str:
    """The QDQ targets and what each stores, for a command's help."""
    return (f"QDQ targets ({flag}):\n"
            + "\n".join(f"  {t.name:13s} {t.description}" for t in QDQ_TARGETS.values()))
