"""Structured outputs: constraints on what a request may generate (JSON schemas, regular
expressions, choices, grammars), the grammar engine that turns them into per-token masks, and
tool calls expressed through them."""
