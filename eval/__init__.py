"""Evaluation: KL, GSM8K, passkey, KV-cache parity, the release gate."""
