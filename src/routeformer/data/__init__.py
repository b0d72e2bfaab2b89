"""Corpora, vocabularies and batching."""

from routeformer.data.batches import random_batch, sequential_batches
from routeformer.data.corpora import Corpus, load_corpus
from routeformer.data.vocab import CharVocab

__all__ = ["CharVocab", "Corpus", "load_corpus", "random_batch", "sequential_batches"]
