"""What a rank keeps of a global batch: its rows and their fields.

Rank 0 draws the user's batch sampler and every rank keeps its rows (:mod:`.sampling`); a dataset
loads only the fields a rank asks for (:mod:`.fields`); a sample that cannot be decoded is skipped
and counted, the same way on every rank (:mod:`.skipping`).
"""
