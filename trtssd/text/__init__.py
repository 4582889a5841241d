"""Text, above the runtime (which deals in token ids only): detokenization, stop strings, stream
deltas and the one record a finished request leaves, run by `LLM` between steps and by the
servers on their event loop, never on the target's cores."""
