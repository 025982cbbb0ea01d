"""Per-rank data loading, field-selective datasets, the embedded demo data and pair datasets."""

from lightning_distmm.data.fields import FieldDataset
from lightning_distmm.data.pairs import CsvPairs, ImageFolderPairs, PairDataset
from lightning_distmm.data.preprocess import CaptionTokenizer, image_transform

__all__ = ["CaptionTokenizer", "CsvPairs", "FieldDataset", "ImageFolderPairs", "PairDataset", "image_transform"]
