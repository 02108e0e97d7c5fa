"""Structured outputs (constrained decoding on xgrammar), the engine core's side, in one home.

A request's StructuredOutputsParams (JSON schema, regex, choice, grammar) is bounded in size
(grammar_limits.py), its JSON schema checked for keywords the grammar cannot enforce
(schema_support.py), and becomes a grammar (grammar_spec.py), compiled once per (constraint,
tokenizer) off the step loop (compiler.py); each constrained sequence keeps a matcher that
fills one row of the step's token bitmask (matchers.py). The engine core drives them through
the StructuredOutputManager (manager.py); the bitmask goes down to the rank that samples as
plain data (``GrammarOutput``), which applies it to the logits on the device in one batched
operation before sampling (pydaemon/sampling/bitmask.py). How a front end names a refused
constraint: pydaemon/entrypoints/common/constraint_errors.py."""
