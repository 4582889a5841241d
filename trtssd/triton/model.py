"""trtssd's Triton model (``<repository>/trtssd/1/model.py``, copied there by `trtssd triton-repo`).

Triton runs this file in its Python-backend stub: an embedded system Python that ignores
PYTHONPATH and virtual environments. So before anything else this module makes that interpreter
act as the one trtssd is installed in, as the config.pbtxt parameters ``TRTSSD_*`` name it: that
environment's site-packages first on ``sys.path`` (its ``.pth`` files included, so an editable
install works), its ``sys.prefix`` (mpi4py finds the MPI library under it) and its
``sys.executable`` (the draft rank is started with it). The standard library stays the stub's
own. This must happen on import, not in ``initialize``: the stub imports
``triton_python_backend_utils``, which needs numpy, right after this module and before
``initialize`` is given the parameters; so the parameters are read from config.pbtxt here.

(Triton's own ``EXECUTION_ENV_PATH`` does not fit a venv: the venv's ``python3`` is found on
PATH and its base installation's standard library gets mixed with the stub's libpython.)
"""

import gc
import os
import re
import site
import sys
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "config.pbtxt"
_PARAMETER = re.compile(r'key:\s*"(TRTSSD_\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}')


def _environment_parameters() -> dict:
    found = dict(_PARAMETER.findall(CONFIG.read_text()))
    missing = {"TRTSSD_PYTHON", "TRTSSD_PREFIX", "TRTSSD_SITE_PACKAGES", "TRTSSD_PYTHON_VERSION"} - set(found)
    if missing:
        raise RuntimeError(f"{CONFIG} lacks the parameter(s) {sorted(missing)}: rewrite it with `trtssd triton-repo`")
    return found


def _enter_environment(parameters: dict) -> None:
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    if parameters["TRTSSD_PYTHON_VERSION"] != running:
        raise RuntimeError(f"trtssd is installed for Python {parameters['TRTSSD_PYTHON_VERSION']} but Triton's stub "
                           f"runs Python {running}: start the server with `trtssd triton-serve`, which picks the stub "
                           "for trtssd's Python")
    before = list(sys.path)
    for directory in parameters["TRTSSD_SITE_PACKAGES"].split(os.pathsep):
        site.addsitedir(directory)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before  # before the system's dist-packages, as in the environment itself
    sys.prefix = sys.exec_prefix = parameters["TRTSSD_PREFIX"]
    sys.executable = parameters["TRTSSD_PYTHON"]


_enter_environment(_environment_parameters())

import triton_python_backend_utils as pb_utils  # noqa: E402 - needs numpy from the environment entered above

from trtssd.triton.backend import TritonModel  # noqa: E402 - likewise


class TritonPythonModel:
    def initialize(self, args):
        self.model = TritonModel(args, pb_utils, Path(__file__).resolve().parent)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
        # Free every object that holds the stub's request and response handles now, while the
        # stub is alive: left to the interpreter's exit they crash it (a segfault in its final
        # garbage collection, seen with Triton 2.51), and then MPI_Finalize never runs to remove
        # this process's MPICH shared memory.
        self.model = None
        gc.collect()
