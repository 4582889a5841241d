#!/usr/bin/env python
"""Benchmark harness: ``python scripts/bench.py ...`` is ``trtssd bench ...`` (see trtssd/bench/).

    python scripts/bench.py --quick --out bench-out
"""

import sys
from pathlib import Path

# Runnable from a plain checkout too (without `pip install -e .`).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtssd.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
