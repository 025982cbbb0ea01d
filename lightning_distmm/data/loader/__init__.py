"""The runtime's side of the data: what each rank loads of a global batch.

Every rank keeps its rows of each global batch and loads only their fields (:mod:`.loading`: a
map-style dataset drawn by index, an iterable one read through :mod:`lightning_distmm.data.streams`);
each step's rows assigned to the towers' replicas by what they cost (:mod:`.balance`); checks of a
dataset against the plan (:mod:`.checks`); and the seeded training loader of the bundled
DataModules (:mod:`.shuffle`).
"""
