"""Every tensor, node or op-type name a user types gets close-match suggestions when it is unknown (issue 27,
item 6): debug --fake-quant, run/report --float-nodes, table set/show."""
import pytest

from ptq.cli import main
from ptq.core.names import close_names
from ptq.calibration.pipeline import calibrate
from test_table_command import RAW
from tiny_models import write_tiny_case

PADDLE = ["p2o.pd_op.batch_norm_.5.0", "p2o.pd_op.batch_norm_.50.0", "p2o.pd_op.conv2d_.5.0", "p2o.pd_op.relu_.5.0"]


def test_names_containing_the_typed_part_come_first_then_close_spellings():
    assert close_names("batch_norm_.5", PADDLE) == ["p2o.pd_op.batch_norm_.5.0", "p2o.pd_op.batch_norm_.50.0"]
    assert close_names("p2o.pd_op.batch_nrm_.5.0", PADDLE)[0] == "p2o.pd_op.batch_norm_.5.0"  # a typo
    assert close_names("gem", ["gemm", "conv", "Gemm"]) == ["Gemm", "gemm"]
    assert close_names("zzz", PADDLE) == []


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    model, images, _ = write_tiny_case(folder, 4)
    table = calibrate(model, images, folder / "table", preprocess=RAW, write_qdq=False).table_path
    return model, images, table


@pytest.mark.parametrize("argv, message", [
    (["debug", "--fake-quant", "gem"], "'gem' is neither a tensor nor a node of the integer graph; "
                                       "did you mean 'gemm'?"),
    (["report", "--float-nodes", "Gem"], "float node 'Gem' is neither a node name, a tensor name nor an op type "
                                         "of the model; did you mean 'Gemm', 'gemm'?"),
    (["run", "--float-nodes", "flaten"], "did you mean 'Flatten', 'flatten', 'flat'?"),
])
def test_an_unknown_layer_name_gets_suggestions(tiny, tmp_path, capsys, argv, message):
    model, images, table = tiny
    command, *flags = argv
    extra = ["--out", str(tmp_path / "out")] if command in ("debug", "report") else []
    status = main([command, str(model), "--quant", str(table), "--images", str(images), *flags, *extra])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"ptq {command}: error: ") and err.count("\n") == 1
    assert err.rstrip("\n").endswith(message)


def test_table_names_get_suggestions(tiny, tmp_path, capsys):
    _, _, table = tiny
    status = main(["table", "set", str(table), "lgits", "--bits", "7", "--out", str(tmp_path / "t.json")])
    assert status == 2 and capsys.readouterr().err == \
        "ptq table: error: tensor 'lgits' is not in the quant table; did you mean 'logits'?\n"
    status = main(["table", "show", str(table), "act_"])
    assert status == 2 and capsys.readouterr().err == \
        "ptq table: error: tensor 'act_' is not in the quant table; did you mean 'act'?\n"
