"""The embedded demo data, generated offline: coloured shapes with captions, digits, and the
small word-level tokenizer they share (no download)."""
