"""The runtime's side of the data: what each rank loads of a global batch.

Every rank keeps its rows of each global batch and loads only their fields (:mod:`.loading`,
:mod:`.balance`; the rows themselves: :mod:`lightning_distmm.data.samples`);
an iterable dataset is read whole by every rank, which decodes only its rows (:mod:`.streaming`,
:mod:`.stream_sources`, :mod:`.litdata_stream`) and checks that every rank read the same samples
(:mod:`.agreement`); checks of a dataset against the plan (:mod:`.checks`) and the seeded training
loader of the bundled DataModules (:mod:`.shuffle`).
"""
