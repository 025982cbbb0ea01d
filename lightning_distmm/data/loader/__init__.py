"""The runtime's side of the data: what each rank loads of a global batch.

Rank 0 draws the user's sampler and every rank keeps its rows (:mod:`.sampling`, :mod:`.loading`);
an iterable dataset is read whole by every rank, which decodes only its rows (:mod:`.streaming`,
:mod:`.stream_sources`, :mod:`.litdata_stream`) and checks that every rank read the same samples
(:mod:`.agreement`); checks of a dataset against the plan (:mod:`.checks`); the field-loading
contract (:mod:`.fields`), the skip-and-count rule for samples that cannot be decoded
(:mod:`.skipping`) and the seeded training loader of the bundled DataModules (:mod:`.shuffle`).
"""
