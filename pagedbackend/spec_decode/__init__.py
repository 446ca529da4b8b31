"""Speculative decoding (vLLM's speculative_config): proposers of draft tokens (n-gram prompt
lookup, a draft model) and the exact verification of the drafts against the target's logits."""
