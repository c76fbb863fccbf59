"""Speculative decoding in the worker: which requests get drafts, and the proposers that write them (the
acceptance rule lives in the sampler, workers/layers/sampler.py)."""
from workers.spec_decode.draft_model import DraftModel
from workers.spec_decode.speculator import Speculator, make_speculator

__all__ = ["DraftModel", "Speculator", "make_speculator"]
