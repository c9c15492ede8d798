"""Every name `ptq` exports resolves, lazily, to the object its module defines."""
import importlib

import pytest

import ptq


@pytest.mark.parametrize("name", sorted(ptq._EXPORTS))
def test_export_resolves_to_its_module_attribute(name):
    assert getattr(ptq, name) is getattr(importlib.import_module(ptq._EXPORTS[name]), name)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        ptq.nonexistent  # noqa: B018
