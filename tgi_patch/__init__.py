"""Batched speculative decoding with D-Cut adaptive verification (issue #5): not implemented yet."""
