#!/usr/bin/env bash
# lm-evaluation-harness through `trtssd serve`: the same two small local tasks scored against the
# server in `--mode ssd` and in `--mode ar` (the embedded default engine), with lm-eval's
# `local-completions` model, as a user points lm-eval at an OpenAI-compatible server.
#   trtssd_mc:  multiple choice, scored by loglikelihood: POST /v1/completions with echo,
#               logprobs 1 and max_tokens 0 (prompt logprobs)
#   trtssd_gen: greedy generation until a newline (two worked answers first), exact match
# The tasks' data (30 questions each) is written here as JSONL: the machine reaches no dataset hub.
# lm-eval lives in a virtualenv of its own (~/.cache/trtssd/lm-eval-venv) so that its
# dependencies never change trtssd's. Writes ssd/, ar/ and compare.md beside itself.
set -euo pipefail
cd "$(dirname "$0")/../../.."
root=$PWD
here=$root/docs/bench/lm-eval-ssd-vs-ar
venv=$HOME/.cache/trtssd/lm-eval-venv
PORT=18454
[[ -x $venv/bin/lm_eval ]] && "$venv/bin/python" -c "import tenacity" 2>/dev/null || {
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "lm-eval[api]==0.4.13" "transformers==$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')"
}
.venv/bin/trtssd build >/dev/null
tokenizer=$root/engines/smollm2-135m/tokenizer
tasks=$(mktemp -d /tmp/trtssd-lm-eval-tasks.XXXXXX)
pid=""
stop() { if [[ -n "$pid" ]]; then kill -INT "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=""; fi; }
cleanup() { stop; rm -rf "$tasks"; }
trap cleanup EXIT

.venv/bin/python - "$tasks" <<'PY'
"""30 arithmetic and capital questions: a multiple-choice set and a generation set."""
import json, random, sys
from pathlib import Path
out = Path(sys.argv[1])
rng = random.Random(0)
capitals = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Russia", "Moscow"), ("Greece", "Athens"),
            ("Norway", "Oslo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Ireland", "Dublin"), ("Poland", "Warsaw"),
            ("Austria", "Vienna")]
cities = [c for _, c in capitals]
# Two worked answers first, so that a small model answers with the word alone (exact match).
SHOTS = "Q: What is the capital of Chile?\nA: Santiago\nQ: What is 3 + 4?\nA: 7\n"
mc, gen = [], []
for country, city in capitals:
    choices = [city] + rng.sample([c for c in cities if c != city], 3)
    rng.shuffle(choices)
    mc.append({"question": f"What is the capital of {country}?", "choices": choices, "answer": choices.index(city)})
    gen.append({"question": SHOTS + f"Q: What is the capital of {country}?\nA:", "answer": f" {city}"})
for _ in range(15):
    a, b = rng.randrange(2, 20), rng.randrange(2, 20)
    right = a + b
    choices = [str(right), str(right + 1), str(right - 2), str(right + 10)]
    rng.shuffle(choices)
    mc.append({"question": f"What is {a} + {b}?", "choices": choices, "answer": choices.index(str(right))})
    gen.append({"question": SHOTS + f"Q: What is {a} + {b}?\nA:", "answer": f" {right}"})
for name, rows in (("mc", mc), ("gen", gen)):
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
(out / "trtssd_mc.yaml").write_text(f"""task: trtssd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {out / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
(out / "trtssd_gen.yaml").write_text(f"""task: trtssd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {out / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
PY

run() {  # mode
  local mode=$1
  .venv/bin/trtssd serve --port "$PORT" --mode "$mode" --max-batch 4 >"$here/$mode.log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do kill -0 "$pid"; sleep 1; done
  HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 "$venv/bin/lm_eval" --model local-completions \
    --model_args "model=smollm2-135m,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$tokenizer,num_concurrent=2,max_retries=3,tokenized_requests=True" \
    --tasks trtssd_mc,trtssd_gen --include_path "$tasks" --output_path "$here/$mode" --log_samples \
    >"$here/$mode-lm-eval.log" 2>&1
  stop
}
run ssd
run ar
.venv/bin/python - "$here" <<'PY'
"""compare.md: each task's score in both modes, and whether every sample's answer was equal."""
import json, sys
from pathlib import Path
here = Path(sys.argv[1])
def latest(mode, pattern):
    return max((here / mode).rglob(pattern), key=lambda p: p.stat().st_mtime)
results = {m: json.loads(latest(m, "results_*.json").read_text())["results"] for m in ("ssd", "ar")}
lines = ["# lm-evaluation-harness through `trtssd serve`: ssd against ar", "",
         "`bash docs/bench/lm-eval-ssd-vs-ar/run.sh`; lm-eval 0.4.13 `local-completions`, the embedded default engine.", "",
         "| task | metric | ssd | ar | equal |", "|---|---|---:|---:|---|"]
for task in sorted(results["ar"]):
    for key, value in results["ar"][task].items():
        if key.endswith(",none") and "stderr" not in key:
            other = results["ssd"][task][key]
            lines.append(f"| {task} | {key.split(',')[0]} | {other:.4f} | {value:.4f} | {other == value} |")
for task in ("trtssd_mc", "trtssd_gen"):
    samples = {m: [json.loads(l) for l in latest(m, f"samples_{task}_*.jsonl").read_text().splitlines()] for m in ("ssd", "ar")}
    same = sum(a["resps"] == b["resps"] for a, b in zip(samples["ssd"], samples["ar"]))
    lines.append(f"\n{task}: {same} of {len(samples['ar'])} samples with identical responses in both modes.")
(here / "compare.md").write_text("\n".join(lines) + "\n")
print((here / "compare.md").read_text())
PY
