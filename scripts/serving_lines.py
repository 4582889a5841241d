"""Count the package lines serving needs: every trtssd module `trtssd serve` imports.

Imports what the serve path imports (the CLI, the OpenAI server and its runner, the LLM, both
executors, the draft rank's process) and sums the lines of the trtssd modules then loaded, beside
the lines of trtssd/runtime and of the whole package. Nothing is started.

    PYTHONPATH=. .venv/bin/python scripts/serving_lines.py [--list]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# The serve path: `trtssd serve` (trtssd/cli.py _serve) in the target's process, and the draft
# rank's process (python -m trtssd.runtime.draft_rank) with either executor it may load.
SERVE_ENTRY_MODULES = (
    "trtssd.cli",
    "trtssd.llm",
    "trtssd.serving.openai_server",
    "trtssd.serving.uvicorn_runner",
    "trtssd.runtime.draft_rank",
    "trtssd.backends.ggml_backend",
    "trtssd.backends.torch_backend",
)


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def serving_modules() -> dict[str, Path]:
    """{module: file} of every trtssd module loaded by importing the serve path."""
    for name in SERVE_ENTRY_MODULES:
        importlib.import_module(name)
    return {name: Path(mod.__file__) for name, mod in sorted(sys.modules.items())
            if (name == "trtssd" or name.startswith("trtssd.")) and getattr(mod, "__file__", None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list each module with its lines")
    args = parser.parse_args(argv)
    package = Path(importlib.import_module("trtssd").__file__).parent
    modules = serving_modules()
    if args.list:
        for name, path in modules.items():
            print(f"{lines(path):6d} {name}")
    runtime = sum(lines(p) for p in (package / "runtime").glob("*.py"))
    total = sum(lines(p) for p in package.rglob("*.py"))
    print(f"serving imports: {sum(lines(p) for p in modules.values())} lines in {len(modules)} modules")
    print(f"trtssd/runtime: {runtime} lines")
    print(f"trtssd (all .py): {total} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
