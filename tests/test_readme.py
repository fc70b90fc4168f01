"""Every Python snippet of the README runs as written."""
import pathlib
import re

import pytest
import torch

_README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_SNIPPETS = re.findall(r"```python\n(.*?)```", _README.read_text(), flags=re.S)


def test_the_readme_has_snippets():
    assert len(_SNIPPETS) >= 5


@pytest.mark.parametrize("snippet", _SNIPPETS, ids=[f"snippet{i}" for i in range(len(_SNIPPETS))])
def test_readme_snippet_runs(snippet):
    # as a reader runs them: PyTorch's own defaults, not the suite's exact float32 (TF32 off)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    exec(compile(snippet, str(_README), "exec"), {"__name__": "readme"})
