"""Speculative decoding with n-gram drafts (`--speculative-algorithm NGRAM`): drafts from each
request's own tokens (ngram.py), checked by the target model in one forward (verify.py)."""
