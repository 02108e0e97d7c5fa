"""The engine core's plain state: requests and their sequences, KV block ownership (SeqBlocks),
stop checking, beam-search selection, the runner's output, statistics and the messages between a
front end and the engine core. The scheduler, which owns all of it, is core/sched/."""
