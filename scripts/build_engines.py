"""Build engine directories (target + draft + tokenizer + manifest); a thin CLI over trtssd.build.

    .venv/bin/python scripts/build_engines.py                      # engines/smollm2-135m
    .venv/bin/python scripts/build_engines.py path/to/model.gguf --name my-model --out /tmp/engines

Building an engine that is already up to date does nothing (see trtssd/build.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from trtssd.build import DEFAULT_ENGINE, DEFAULT_HEAD_TOP_K, DRAFT_DTYPES, REGISTERED, build_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build trtssd engine directories")
    parser.add_argument("refs", nargs="*", default=[DEFAULT_ENGINE],
                        help=f"named engines ({', '.join(REGISTERED)}), .gguf files or Hugging Face directories "
                        f"(default: {DEFAULT_ENGINE})")
    parser.add_argument("--out", default=None, help="engines directory (default: engines/ of the checkout)")
    parser.add_argument("--name", default=None, help="engine directory name (one ref only)")
    parser.add_argument("--draft", default=None, help="another model as the draft, same tokenizer (one ref only)")
    parser.add_argument("--draft-dtype", choices=DRAFT_DTYPES, default=None,
                        help="int4 (quantize a GGUF's weights), float32 or bfloat16 (default: int4 for a "
                        "self-draft, float32 for another model)")
    parser.add_argument("--head-top-k", type=int, default=DEFAULT_HEAD_TOP_K,
                        help="draft output rows re-scored in fp32 (0 = pure int4 head)")
    parser.add_argument("--force", action="store_true", help="rebuild even when up to date")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if len(args.refs) > 1 and (args.name or args.draft):
        parser.error("--name and --draft apply to a single ref")
    try:
        for ref in args.refs:
            path = build_engine(ref, args.out, draft=args.draft, name=args.name, head_top_k=args.head_top_k,
                                draft_dtype=args.draft_dtype, force=args.force)
            sys.stdout.write(f"{path}\n")
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
