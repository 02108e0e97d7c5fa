"""Speculative decoding in the model runner: proposers (proposer.py: the interface;
ngram_proposer.py), the rejection sampler that verifies drafts exactly
(rejection_sampler.py) and the step glue (spec_decoder.py)."""
