"""Execute the book's notebooks without Jupyter: every code cell, in order, in one
namespace per notebook, from ``book/`` (where the notebooks read their results).

For machines that have the package's dependencies but not Jupyter (a GPU image, say):
``python tests/run_notebooks.py book/*.ipynb``. Exits 1 if any cell raises.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import traceback
import types


def _display_shim() -> None:
    """``IPython.display.display`` as ``print`` where IPython is not installed."""
    try:
        import IPython.display  # noqa: F401
    except ImportError:
        display = types.ModuleType("IPython.display")
        display.display = lambda *objects, **_: print(*objects)
        display.Markdown = display.HTML = str
        package = types.ModuleType("IPython")
        package.display = display
        package.version_info = (99, 0)  # matplotlib asks; a recent release needs no set-up from it
        package.get_ipython = lambda: None
        sys.modules.update({"IPython": package, "IPython.display": display})


def run(path: pathlib.Path) -> bool:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    namespace = {"__name__": "__main__"}
    start = time.time()
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        for number, cell in enumerate(cells, 1):
            source = "".join(cell["source"])
            try:
                exec(compile(source, f"{path.name}[{number}]", "exec"), namespace)
            except Exception:
                print(f"FAILED {path} cell {number} of {len(cells)}:\n{source[:400]}\n{traceback.format_exc()}")
                return False
            finally:
                import matplotlib.pyplot as plt

                plt.close("all")
    finally:
        os.chdir(cwd)
    print(f"ok {path}: {len(cells)} code cells in {time.time() - start:.1f} s")
    return True


def main(argv) -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")
    _display_shim()
    results = [run(pathlib.Path(p).resolve()) for p in argv]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
