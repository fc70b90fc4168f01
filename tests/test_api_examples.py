"""Every public name documents itself with an example that runs and prints what it shows.

The API reference (``book/api.md``) renders these docstrings; each ``Example:`` section is
run here as a doctest, in an empty namespace, so an example must make its own imports.
"""
import doctest
import io
import pathlib
import re

import pytest
import torch

import packed_kernels as pk

_API_PAGE = pathlib.Path(__file__).resolve().parents[1] / "book" / "api.md"
_OPTIONS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS


def _examples_of(name):
    """The doctests of the public ``name``'s own docstring (not of its methods)."""
    return doctest.DocTestFinder(recurse=False).find(getattr(pk, name), name, globs={})


@pytest.mark.parametrize("name", pk.__all__)
def test_public_name_has_an_example(name):
    docstring = getattr(pk, name).__doc__ or ""
    assert "Example:" in docstring, f"{name}'s docstring has no Example: section"
    assert sum(len(test.examples) for test in _examples_of(name)) > 0, f"{name}'s Example: has no >>> lines"


@pytest.mark.parametrize("name", pk.__all__)
def test_public_name_example_runs(name):
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=_OPTIONS)
    with torch.random.fork_rng(devices=[]):  # an example that draws numbers leaves the suite's generator alone
        for test in _examples_of(name):
            runner.run(test, out=report.write)
    assert runner.tries > 0, f"{name} has no example"
    assert runner.failures == 0, f"{runner.failures} of {runner.tries} example lines of {name} failed:\n" \
                                 f"{report.getvalue()}"


def test_api_page_documents_every_public_name():
    page = _API_PAGE.read_text()
    documented = set(re.findall(r"^\.\. auto(?:function|class):: packed_kernels\.(\w+)", page, flags=re.M))
    assert set(pk.__all__) <= documented, f"missing from book/api.md: {sorted(set(pk.__all__) - documented)}"


def test_api_page_shows_no_values_of_the_machine_that_builds_it():
    page = _API_PAGE.read_text()
    assert not re.search(r"^\.\. automodule:: packed_kernels\.runtime", page, flags=re.M)
    for name in ("INTERPRETED", "KERNEL_DEVICE"):
        entry = re.search(rf"^\.\. autodata:: packed_kernels\.runtime\.{name}\n((?:   .*\n)*)", page, flags=re.M)
        assert entry and ":no-value:" in entry.group(1), f"runtime.{name} must be an autodata entry with :no-value:"
