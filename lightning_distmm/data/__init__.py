"""Per-rank data loading, field-selective datasets and streams, the embedded demo data and pair datasets."""

from lightning_distmm.data.agreement import rank_independent
from lightning_distmm.data.fields import FieldDataset
from lightning_distmm.data.litdata_pairs import LitDataPairs
from lightning_distmm.data.pairs import CsvPairs, ImageFolderPairs, PairDataset
from lightning_distmm.data.preprocess import CaptionTokenizer, image_transform
from lightning_distmm.data.streaming import FieldStream
from lightning_distmm.data.webdataset import WebDatasetPairs

__all__ = [
    "CaptionTokenizer",
    "CsvPairs",
    "FieldDataset",
    "FieldStream",
    "ImageFolderPairs",
    "LitDataPairs",
    "PairDataset",
    "WebDatasetPairs",
    "image_transform",
    "rank_independent",
]
