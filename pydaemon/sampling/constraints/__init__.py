"""Constrained decoding on xgrammar: a request's StructuredOutputsParams (JSON schema, regex,
choice, grammar) becomes a grammar (grammar_spec.py), compiled once per (constraint,
tokenizer) off the step loop (compiler.py); each constrained sequence keeps a matcher that
fills one row of the step's token bitmask (matchers.py), applied to the logits on the device
in one batched operation before sampling (bitmask.py)."""
