"""Speculative decoding in the model runner: proposers (proposer.py: the interface;
ngram_proposer.py), the rejection sampler that verifies drafts exactly
(rejection_sampler.py); the step glue is pydaemon/worker/spec_decoder.py (this folder is a
layer below the runner: it imports nothing of worker/)."""
