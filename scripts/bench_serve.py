#!/usr/bin/env python
"""Serving benchmark: ``python scripts/bench_serve.py ...`` is ``trtssd bench serve ...`` (see trtssd/bench/serve.py).

    python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --concurrency 1,2,4,8,16 --out serve-out
"""

import sys
from pathlib import Path

# Runnable from a plain checkout too (without `pip install -e .`).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtssd.bench.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
