"""Scheduling: the Scheduler (owner of the one BlockManager), the StepPlan it fills, the plain
SchedulerOutput it hands the model runner and its builder, the post-step updater, beam steps and the
async stepper that overlaps the next schedule with the running step."""
