"""Per-rank data loading, field-selective datasets and streams, the embedded demo data and pair datasets."""

from lightning_distmm.data.datasets.conversations import ConversationPairs
from lightning_distmm.data.datasets.litdata_pairs import LitDataPairs
from lightning_distmm.data.datasets.pairs import CsvPairs, ImageFolderPairs, PairDataset
from lightning_distmm.data.datasets.preprocess import CaptionTokenizer, image_transform
from lightning_distmm.data.datasets.webdataset import WebDatasetPairs
from lightning_distmm.data.samples.fields import FieldDataset
from lightning_distmm.data.streams.agreement import rank_independent
from lightning_distmm.data.streams.streaming import FieldStream

__all__ = [
    "CaptionTokenizer",
    "ConversationPairs",
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
