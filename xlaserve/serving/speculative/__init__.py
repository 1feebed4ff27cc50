"""Speculative decoding on the host: proposers and the bookkeeping of what they got accepted.

    scheduler.schedule()  a running decode row of a request that speculates asks the proposer
                          for up to k draft tokens past its last token (NgramProposer: prompt
                          lookup over the request's own tokens; or a BatchProposer, a draft
                          model run for all rows at once: engine/draft_proposer.py, its KV
                          tracked by DraftProgress) and is scheduled as 1 + k query tokens,
                          its KV slots reserved for all of them
    runner                samples every one of those positions (one sample row each)
    scheduler.update()    accept_drafts: the drafts up to the first one the target model did
                          not sample, then the target's own token; the rejected drafts' KV
                          slots are given back (KVCacheManager.trim), SpecStats counts them

Plain Python, no jax (the scheduler imports it).
"""

from xlaserve.serving.speculative.acceptance import accept_drafts
from xlaserve.serving.speculative.config import SpeculativeConfig
from xlaserve.serving.speculative.draft_progress import BatchProposer, DraftProgress, DraftQuery
from xlaserve.serving.speculative.ngram import NgramProposer
from xlaserve.serving.speculative.stats import SpecStats

__all__ = ["BatchProposer", "DraftProgress", "DraftQuery", "NgramProposer", "SpecStats",
           "SpeculativeConfig", "accept_drafts"]
