"""`tandem.loading.load`: the one `module:attr` loader, and what it tells its callers."""

import os.path

import pytest

from tandem.loading import LoadError, load


def test_a_name_loads_its_object_through_a_dotted_attribute():
    assert load("os.path:join") is os.path.join
    assert load("tandem.loading:LoadError.__name__") == "LoadError"


@pytest.mark.parametrize(
    "name, reason",
    [
        ("os.path", "shape"),
        ("os:", "shape"),
        (":join", "shape"),
        ("my-module:f", "shape"),
        ("os:1st", "shape"),
        ("no_such_module_xyz:f", "import"),
        ("os.path:no_such_function", "attribute"),
    ],
)
def test_a_bad_name_says_which_part_failed(name, reason):
    with pytest.raises(LoadError) as caught:
        load(name)
    e = caught.value
    assert e.reason == reason and e.name == name and repr(name) in str(e)
    if reason == "import":
        assert isinstance(e.error, ImportError) and e.module == "no_such_module_xyz"


def test_a_module_that_fails_as_it_runs_is_not_a_bad_name(tmp_path, monkeypatch):
    """Its own exception reaches the caller as it is, an AttributeError included (not taken for a
    missing attribute of a module that imported)."""
    (tmp_path / "raises_attribute_error_xyz.py").write_text("import os\nos.no_such_thing\n")
    (tmp_path / "raises_value_error_xyz.py").write_text("raise ValueError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AttributeError, match="no_such_thing"):
        load("raises_attribute_error_xyz:f")
    with pytest.raises(ValueError, match="at import"):
        load("raises_value_error_xyz:f")
