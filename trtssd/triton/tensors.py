"""The Triton model's inputs and outputs: one table, read by the repository writer (config.pbtxt)
and by the model (parsing requests, building responses).

The names are the ones existing Triton LLM clients send and read: vLLM's Triton backend
(``text_input``, ``stream``, ``sampling_parameters``, ``exclude_input_in_output`` ->
``text_output``, ``finish_reason``, ``num_input_tokens``, ``num_output_tokens``) and TensorRT-LLM's
(the optional scalars ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
``stop_words``; its speculation outputs ``acceptance_rate``, ``total_accepted_draft_tokens``,
``total_draft_tokens``; ``output_ids``; ``return_log_probs`` -> ``output_log_probs``,
``cum_log_probs``; guided decoding: ``guided_decoding_guide_type``, ``guided_decoding_guide``;
several samples: ``num_return_sequences`` -> ``sequence_index``;
penalties and biases: ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
``min_tokens`` (or ``min_length``), ``bad_words``, ``embedding_bias``, ``embedding_bias_words`` with
``embedding_bias_weights``). So ``vllm bench serve --backend tensorrt-llm`` and clients written for
either backend work unchanged.

Where the shapes differ from TensorRT-LLM's: its models batch (``max_batch_size`` > 0), so a client
sees its outputs with a leading batch dimension ([1, beams, tokens] for ``output_log_probs``); this
model batches inside the engine and declares ``max_batch_size: 0``, so the same tensors come without
it. The beam dimension is kept (always 1: there is no beam search) so that index [0] still picks
the one beam. ``output_ids`` stays flat ([tokens]) as it always was here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorDef:
    name: str
    data_type: str  # config.pbtxt's TYPE_*
    dims: tuple[int, ...]  # without a batch dimension (max_batch_size is 0)
    optional: bool
    doc: str


INPUTS = (
    TensorDef("text_input", "TYPE_STRING", (1,), False, "the prompt, as text"),
    TensorDef("stream", "TYPE_BOOL", (1,), True, "true: one response per round with only its new text"),
    TensorDef("sampling_parameters", "TYPE_STRING", (1,), True,
               "JSON object as vLLM's backend takes it: temperature, top_p, top_k, min_p, max_tokens, "
               "seed, stop, stop_token_ids, ignore_eos, logprobs (checked; its alternatives are not returned)"),
    TensorDef("exclude_input_in_output", "TYPE_BOOL", (1,), True,
               "without streaming: false (default) puts the prompt before the generated text"),
    TensorDef("max_tokens", "TYPE_INT32", (1,), True, "most tokens to generate"),
    TensorDef("temperature", "TYPE_FP32", (1,), True, "0 = greedy"),
    TensorDef("top_p", "TYPE_FP32", (1,), True, "nucleus sampling mass; 1 = off"),
    TensorDef("top_k", "TYPE_INT32", (1,), True, "keep the k most likely tokens; 0 (or -1) = off"),
    TensorDef("min_p", "TYPE_FP32", (1,), True, "drop tokens below min_p x the top probability; 0 = off"),
    TensorDef("seed", "TYPE_UINT64", (1,), True, "per-request seed: the same request repeats its output"),
    TensorDef("stop_words", "TYPE_STRING", (-1,), True, "stop strings"),
    TensorDef("ignore_eos", "TYPE_BOOL", (1,), True, "keep generating past end-of-sequence (benchmarks)"),
    TensorDef("return_log_probs", "TYPE_BOOL", (1,), True,
               "true: add output_log_probs and cum_log_probs to every response"),
    TensorDef("num_return_sequences", "TYPE_INT32", (1,), True,
               "samples of the prompt (1 by default, at most the model's max_batch): each response carries "
               "one sample's output and its sequence_index"),
    TensorDef("guided_decoding_guide_type", "TYPE_STRING", (1,), True,
               "the output's constraint: json (any JSON object), json_schema, regex or ebnf_grammar"),
    TensorDef("guided_decoding_guide", "TYPE_STRING", (1,), True,
               "the constraint's schema, regex or EBNF grammar (none for json)"),
    TensorDef("presence_penalty", "TYPE_FP32", (1,), True,
               "in [-2, 2]: lowers the logit of each token the output holds (OpenAI's); 0 = off"),
    TensorDef("frequency_penalty", "TYPE_FP32", (1,), True,
               "in [-2, 2]: lowers each token's logit by this times its count in the output (OpenAI's); 0 = off"),
    TensorDef("repetition_penalty", "TYPE_FP32", (1,), True,
               "in [0.01, 100]: divides the positive logits of the prompt's and output's tokens, multiplies the "
               "others; 1 = off"),
    TensorDef("min_tokens", "TYPE_INT32", (1,), True, "no end-of-sequence or stop token before this many output tokens"),
    TensorDef("min_length", "TYPE_INT32", (1,), True, "min_tokens by TensorRT-LLM's older name"),
    TensorDef("bad_words", "TYPE_STRING", (-1,), True,
               "words the output never completes: each word's last token is banned where the text ends with its others"),
    TensorDef("embedding_bias", "TYPE_FP32", (-1,), True,
               "[vocab] added to the logits (by token id, as OpenAI's logit_bias: values in [-100, 100])"),
    TensorDef("embedding_bias_words", "TYPE_STRING", (-1,), True,
               "words whose tokens get the matching embedding_bias_weights added to their logits"),
    TensorDef("embedding_bias_weights", "TYPE_FP32", (-1,), True, "one bias per embedding_bias_words entry"),
)

OUTPUTS = (
    TensorDef("text_output", "TYPE_STRING", (-1,), False, "generated text (streaming: this response's new text)"),
    TensorDef("output_ids", "TYPE_INT32", (-1,), False, "generated token ids (streaming: this response's new ones)"),
    TensorDef("finish_reason", "TYPE_STRING", (-1,), False, "'stop' or 'length' in the last response, else ''"),
    TensorDef("sequence_index", "TYPE_INT32", (1,), False,
               "which of the request's num_return_sequences samples the response is about (0 for the first)"),
    TensorDef("num_input_tokens", "TYPE_UINT32", (1,), False, "prompt tokens"),
    TensorDef("num_output_tokens", "TYPE_UINT32", (-1,), False, "tokens generated so far"),
    TensorDef("acceptance_rate", "TYPE_FP32", (1,), False,
               "accepted / proposed draft tokens over the request (last response; 0 before)"),
    TensorDef("total_accepted_draft_tokens", "TYPE_INT32", (1,), False, "draft tokens accepted (last response)"),
    TensorDef("total_draft_tokens", "TYPE_INT32", (1,), False, "draft tokens proposed (last response)"),
    TensorDef("cache_hit_rate", "TYPE_FP32", (1,), False,
               "SSD rounds answered from the speculation cache / SSD rounds (last response)"),
    # Only with return_log_probs (LOG_PROB_OUTPUTS). TensorRT-LLM's dims: [beams, tokens] and [beams].
    TensorDef("output_log_probs", "TYPE_FP32", (-1, -1), False,
               "[1, n]: the log-probability of each token in output_ids, under the target's processed "
               "distribution"),
    TensorDef("cum_log_probs", "TYPE_FP32", (-1,), False, "[1]: their sum over the tokens generated so far"),
)

# The outputs a response carries only when the request set return_log_probs.
LOG_PROB_OUTPUTS = ("output_log_probs", "cum_log_probs")

# The scalar inputs that set one SamplingParams field each (input name -> field name).
SAMPLING_INPUTS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "min_p": "min_p", "seed": "seed", "stop_words": "stop", "ignore_eos": "ignore_eos",
                   "num_return_sequences": "n",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "min_length": "min_tokens"}
