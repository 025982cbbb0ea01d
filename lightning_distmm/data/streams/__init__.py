"""Iterable datasets under distmm: every rank reads the same stream, and decodes only its rows.

A stream is read raw and decoded per field (:mod:`.streaming`); which iterable datasets are read,
and as what (:mod:`.stream_sources`); LitData's ``StreamingDataset`` read as one process reads it
(:mod:`.litdata_stream`); and the check, while training, that every rank read the same samples
(:mod:`.agreement`).
"""
