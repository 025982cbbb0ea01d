"""The step: the engine that runs a rank's share of each training step (:mod:`.engine`), a
microbatch's passes through the rank's stage (:mod:`.passes`), the instructions where ranks meet
(the batch-sync, :mod:`.batch_sync`; the VLM handoff, :mod:`.handoff`), the gradients'
hand-off and sums (:mod:`.gradients`), and the state one step carries from Lightning's hooks to
its backward (:mod:`.state`)."""
