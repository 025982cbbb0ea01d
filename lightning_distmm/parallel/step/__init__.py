"""The step: the engine that runs a rank's share of each training step (:mod:`.engine`) and the
state one step carries from Lightning's hooks to its backward (:mod:`.state`)."""
