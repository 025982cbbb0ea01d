"""Datasets and DataModules of image-caption pairs: CSV and image-folder pairs, WebDataset and
LitData streams, class folders for zero-shot, their image transforms and caption tokenizers. Each
loads only the fields a rank asks for.
"""
